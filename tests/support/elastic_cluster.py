"""Run one job on its own multi-node ``ray.cluster_utils.Cluster`` and write its summary as JSON.

``tests/test_elastic_nodes.py`` runs this as a subprocess: the test process is
already a driver of the session's single-node cluster, and a process can be a
driver of one cluster only. The head gets no CPUs, so every rank lives on a
worker node that ``kill_node`` may take down; with ``--add-node-after-shrink``
a fresh node joins once the job has shrunk, as a replaced machine would.

``--topology A,B,C`` gives the worker nodes, in the order they join, the ``raymesh.io/topology`` label
(``orchestrator/runtime/node_order.py``).

``--drain-rank R --drain-at S``: once step S is shown, the node hosting rank R is drained through Ray's own CLI
(``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``, as an autoscaler or KubeRay sends for a spot
reclaim, with the session's token auth), and once the job has recovered the node is taken down (the platform
ending it at the drain's deadline). The output names it (``drained_node``).

usage: python -m tests.support.elastic_cluster SPEC.json OUT.json --nodes N --cpus C --port P [--add-node-after-shrink]
       [--topology LABELS] [--drain-rank R --drain-at S]
(``run_on_cluster`` does that from a test).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from orchestrator import JobSpec, TrainingJob
from orchestrator.observability.observers import JobObserver
from orchestrator.runtime.node_order import TOPOLOGY_LABEL

ROOT = Path(__file__).resolve().parents[2]
PORT = 6395  # the session cluster's GCS listens on 6389

# a lost node is declared dead after ~1.5 s instead of Ray's default ~15 s
FAST_NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                   "health_check_initial_delay_ms": 0}


class ShrinkGate(JobObserver):
    """Holds the job right after it shrank until the replacement node has joined.

    Without it the few steps left could all run before the node registers (it takes seconds), and the job
    would end without the grow-back the test is about.
    """

    def __init__(self) -> None:
        self.shrunk, self.joined = threading.Event(), threading.Event()

    def on_resized(self, record, layout: dict) -> None:
        if record.reason == "shrink":
            self.shrunk.set()
            self.joined.wait(120)


class DrainAt(JobObserver):
    """Says (``due``) which node to drain once step ``at`` is shown: the node rank ``rank`` lives on then; and
    when the job has recovered (``recovered``), so the drained node can be taken down."""

    def __init__(self, job: TrainingJob, rank: int, at: int):
        self.job, self.rank, self.at = job, rank, at
        self.node: str | None = None
        self.due, self.recovered = threading.Event(), threading.Event()

    def on_step(self, report) -> None:
        if report.record["step"] == self.at and self.node is None:
            self.node = self.job.layout.ranks[self.rank].node_id
            self.due.set()

    def on_recovered(self, record, step: int, restarted: int, phases_s: dict) -> None:
        if record.kind == "drain":
            self.recovered.set()


def drain(address: str, node: str, deadline_s: int = 120) -> None:
    """Drain ``node`` as a spot reclaim does, through Ray's CLI (it exits non-zero when the GCS refuses)."""
    subprocess.run(["ray", "drain-node", "--address", address, "--node-id", node, "--reason",
                    "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "raymesh test: spot instance reclaimed",
                    "--deadline-remaining-seconds", str(deadline_s)], check=True, capture_output=True, timeout=60)


def run_on_cluster(spec: JobSpec, tmp_path: Path, *extra: str) -> dict:
    """Run ``spec`` on a cluster of its own in a subprocess (``extra``: this script's options); its output JSON."""
    spec_file, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec_file.write_text(json.dumps(spec.to_dict()))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    subprocess.run([sys.executable, "-m", "tests.support.elastic_cluster", str(spec_file), str(out),
                    "--port", str(PORT), *extra], cwd=ROOT, env=env, check=True, timeout=300)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("out")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--cpus", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--add-node-after-shrink", action="store_true")
    parser.add_argument("--topology", default="", help="comma-separated raymesh.io/topology labels, one a node")
    parser.add_argument("--drain-rank", type=int)
    parser.add_argument("--drain-at", type=int)
    args = parser.parse_args()
    labels = args.topology.split(",") if args.topology else [""] * args.nodes

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "gcs_server_port": args.port, "include_dashboard": False, "_system_config": FAST_NODE_DEATH})
    try:
        nodes = [cluster.add_node(num_cpus=args.cpus, labels={TOPOLOGY_LABEL: label} if label else {})
                 for label in labels]
        ray.init(address=cluster.address, log_to_driver=False)
        job = TrainingJob(JobSpec.from_dict(json.loads(Path(args.spec).read_text())), progress=False)
        out = {}
        gate = ShrinkGate()
        if args.add_node_after_shrink:
            job.observers.add(gate)
        drain_at = DrainAt(job, args.drain_rank, args.drain_at) if args.drain_at else None
        if drain_at is not None:
            job.observers.add(drain_at)

        def train() -> None:
            try:
                out["result"] = job.run().to_dict()
            except Exception as exc:  # the test asserts on the message
                out["error"] = f"{type(exc).__name__}: {exc}"

        thread = threading.Thread(target=train)
        thread.start()
        if args.add_node_after_shrink:
            while thread.is_alive() and not gate.shrunk.wait(0.2):
                pass
            if thread.is_alive():
                cluster.add_node(num_cpus=args.cpus)  # starting a node needs the main thread (signal handlers)
            gate.joined.set()
        if drain_at is not None:
            drain_node(cluster, nodes, drain_at, thread, out)
        thread.join()
        out["dead_nodes"] = [n["NodeID"] for n in ray.nodes() if not n["Alive"]]
        Path(args.out).write_text(json.dumps(out))
    finally:
        ray.shutdown()
        cluster.shutdown()


def drain_node(cluster: Cluster, nodes: list, drain_at: DrainAt, thread: threading.Thread, out: dict) -> None:
    """The drain, from the main thread (the CLI runs as a process of its own), then the drained node taken down
    once the job recovered: the ranks must have left it by then, so nothing of the job notices."""
    while thread.is_alive() and not drain_at.due.wait(0.2):
        pass
    if not thread.is_alive():
        return
    drain(cluster.address, drain_at.node)
    out["drained_node"] = drain_at.node
    while thread.is_alive() and not drain_at.recovered.wait(0.2):
        pass
    if thread.is_alive():
        cluster.remove_node(next(n for n in nodes if n.node_id == drain_at.node))
        out["removed_drained_node"] = True


if __name__ == "__main__":
    main()
