"""The tiny test job and waiting helpers shared by the tests."""

from __future__ import annotations

import time
from pathlib import Path

from orchestrator import JobSpec

TINY = {
    "model": {"d_model": 32, "n_layers": 4, "n_heads": 4, "d_ff": 64, "seq_len": 32},
    "parallel": {"device": "cpu"},
    "optim": {"lr": 3e-3},
    "train": {"steps": 10, "global_batch_size": 8, "microbatches": 2},
    # no warm spare: its start-up (a process importing torch, ~5 s of CPU here) buys nothing in a job that
    # loses no rank; the recovery tests that run on the job file's defaults set it back (``ON_DEFAULTS``)
    "fault_tolerance": {"warm_spares": False},
}
# the job file's recovery defaults, for a test that says it recovers on them (``tiny_spec`` turns spares off)
ON_DEFAULTS = {"checkpoint": {}, "fault_tolerance": {"warm_spares": True}}


def tiny_spec(token_data: Path, tmp_path: Path, **sections) -> JobSpec:
    """The tiny test job with ``sections`` merged over it (one level deep)."""
    raw = {k: dict(v) for k, v in TINY.items()}
    for name, fields in sections.items():
        raw.setdefault(name, {}).update(fields)
    raw["data"] = {"path": str(token_data)}
    raw["run_dir"] = str(tmp_path / "run")
    return JobSpec.from_dict(raw)


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    """``predicate()``'s first true value, looked at every ``poll_s`` until ``timeout_s`` (a safety net: a test
    waits for a state, never for a time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
