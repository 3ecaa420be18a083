"""``raymesh run``/``raymesh attach`` as real subprocesses joined to the session's Ray cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from orchestrator import JobSpec

REPO = Path(__file__).parents[2]


def cli_env(ray_cluster: dict) -> dict:
    """The session cluster's environment with this checkout first on the path (the actors get it from us)."""
    return {**ray_cluster["env"], "RAY_ADDRESS": ray_cluster["address"], "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1"}


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


def raymesh(ray_cluster: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``raymesh ARGS`` to its end."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], env=cli_env(ray_cluster), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a driver started by ``start_raymesh`` (its own session) if it still runs."""
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
        proc.wait()
