"""``raymesh run``/``raymesh attach`` as real subprocesses joined to the session's Ray cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from orchestrator import JobSpec

REPO = Path(__file__).parents[2]


def cli_env(ray_cluster: dict, by_address: bool = True) -> dict:
    """The session cluster's environment with this checkout first on the path (the actors get it from us).

    ``by_address=False``: no ``RAY_ADDRESS``, as in the shell of a user who ran ``ray start --head`` on this
    machine; raymesh must find that cluster itself."""
    env = {**ray_cluster["env"], "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    return {**env, "RAY_ADDRESS": ray_cluster["address"]} if by_address else env


def slowed(spec: JobSpec, factor: float = 15.0) -> JobSpec:
    """``spec`` with every step of rank 0 stretched ``factor`` times (a sleep: the losses do not change), so a test
    can act on a tiny job mid-run: ~1.5 s a step on 2 busy cores, ~0.25 s on a fast machine (~15 ms otherwise)."""
    return JobSpec.from_dict({**spec.to_dict(), "faults": [{"kind": "slow_rank", "rank": 0, "at_step": 1,
                                                             "factor": factor}]})


def job_file(spec: JobSpec, folder: Path) -> Path:
    """``spec`` as a job file (JSON is YAML)."""
    path = folder / "job.yaml"
    path.write_text(json.dumps(spec.to_dict()))
    return path


def start_raymesh(ray_cluster: dict, *args: str, out: Path) -> subprocess.Popen:
    """``raymesh ARGS`` in the background, stdout and stderr to ``out``.stdout/.stderr."""
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], env=cli_env(ray_cluster), cwd=REPO,
                            stdout=open(f"{out}.stdout", "w"), stderr=open(f"{out}.stderr", "w"),
                            start_new_session=True)


def output(out: Path) -> tuple[str, str]:
    return Path(f"{out}.stdout").read_text(), Path(f"{out}.stderr").read_text()


def raymesh(ray_cluster: dict, *args: str, timeout: float = 300,
            by_address: bool = True) -> subprocess.CompletedProcess:
    """``raymesh ARGS`` to its end (``by_address``: see ``cli_env``)."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], env=cli_env(ray_cluster, by_address),
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a driver started by ``start_raymesh`` (its own session) if it still runs."""
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
        proc.wait()
