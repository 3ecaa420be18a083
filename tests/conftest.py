"""Shared fixtures: one real Ray cluster (``ray start --head``) and one small token corpus per session.

Starting Ray costs ~10 s here, so every test that trains joins the same head
node; it is a real cluster with a dashboard, so ``ray job submit`` tests use it
too.
"""

from __future__ import annotations

import os
import subprocess
import sysconfig
import time
from pathlib import Path

import pytest

from orchestrator import JobSpec
from workers.data import prepare_data

RAY_CPUS = 8
DASHBOARD_PORT = 8265
GCS_PORT = 6389

TINY = {
    "model": {"d_model": 32, "n_layers": 4, "n_heads": 4, "d_ff": 64, "seq_len": 32},
    "parallel": {"device": "cpu"},
    "optim": {"lr": 3e-3},
    "train": {"steps": 10, "global_batch_size": 8, "microbatches": 2},
}


@pytest.fixture(scope="session")
def token_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~50K byte tokens of the stdlib's json package: big enough for 40 steps without repeats."""
    out = tmp_path_factory.mktemp("tokens")
    prepare_data([Path(sysconfig.get_paths()["stdlib"]) / "json"], out)
    return out


@pytest.fixture(scope="session")
def ray_cluster():
    """A head node started the way users start one; the test process joins it as a driver."""
    import ray

    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    subprocess.run(["ray", "stop", "--force"], capture_output=True, env=env)
    subprocess.run(
        ["ray", "start", "--head", f"--num-cpus={RAY_CPUS}", f"--port={GCS_PORT}",
         "--include-dashboard=true", f"--dashboard-port={DASHBOARD_PORT}", "--disable-usage-stats"],
        check=True, capture_output=True, env=env,
    )
    address = f"127.0.0.1:{GCS_PORT}"
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address=address, log_to_driver=False)
    yield {"address": address, "dashboard": f"http://127.0.0.1:{DASHBOARD_PORT}", "env": env}
    ray.shutdown()
    subprocess.run(["ray", "stop", "--force"], capture_output=True, env=env)


def tiny_spec(token_data: Path, tmp_path: Path, **sections) -> JobSpec:
    """The tiny test job with ``sections`` merged over it (one level deep)."""
    raw = {k: dict(v) for k, v in TINY.items()}
    for name, fields in sections.items():
        raw.setdefault(name, {}).update(fields)
    raw["data"] = {"path": str(token_data)}
    raw["run_dir"] = str(tmp_path / "run")
    return JobSpec.from_dict(raw)


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
