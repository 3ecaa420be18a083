"""Submit one job through the job server of a two-node ``ray.cluster_utils.Cluster`` and write what came back.

Run as a subprocess (``submit_on_two_nodes``): the test process is already a driver of the session's cluster.
The head has one CPU, the second node one, so a dp=2 job's two ranks must land one on each node. Its GCS,
dashboard and two dashboard-agent ports are picked free, outside the ephemeral range (``tests/support/ports.py``):
an agent that cannot bind leaves the job server with "No available agent to submit job", and the agents' fixed
52375/52376 lay in the range the suite's other processes take ports from.

usage: python -m tests.support.two_node_submit JOB.json OUT.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from tests.support.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]


def submit_on_two_nodes(job: dict, tmp_path: Path) -> dict:
    """Run ``job`` (a job-file dict) on a fresh two-node cluster through ``ray job submit``; the output JSON."""
    job_file, out = tmp_path / "job.json", tmp_path / "out.json"
    job_file.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    subprocess.run([sys.executable, "-m", "tests.support.two_node_submit", str(job_file), str(out)],
                   cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, check=True, timeout=400)
    return json.loads(out.read_text())


def _submit(client, **job) -> str:
    """``client.submit_job``, retried while the head's dashboard agent is still starting (HTTP 500 "No available
    agent" for the first seconds of a fresh cluster)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return client.submit_job(**job)
        except RuntimeError as exc:
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(1)


def main() -> None:
    job_file, out = Path(sys.argv[1]), Path(sys.argv[2])
    from ray.job_submission import JobStatus, JobSubmissionClient

    gcs_port, dashboard_port, *agent_ports = free_ports(4)  # each node's dashboard agent has its own
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "gcs_server_port": gcs_port, "include_dashboard": True, "dashboard_port": dashboard_port,
        "dashboard_agent_listen_port": agent_ports[0]})
    try:
        cluster.add_node(num_cpus=1, dashboard_agent_listen_port=agent_ports[1])
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        client = JobSubmissionClient(f"http://127.0.0.1:{dashboard_port}")
        summary = job_file.with_name("summary.json")
        job_id = _submit(client, entrypoint=f"{sys.executable} -m orchestrator.cli run {job_file} --summary-json "
                         f"{summary}", runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
        deadline = time.monotonic() + 300
        while (status := client.get_job_status(job_id)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED,
                                                                 JobStatus.STOPPED}:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {status} after 300 s")
            time.sleep(1)
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        result = json.loads(summary.read_text()) if summary.is_file() else None
        out.write_text(json.dumps({"status": str(status.value), "nodes": nodes, "summary": result,
                                   "logs": client.get_job_logs(job_id)[-4000:]}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
