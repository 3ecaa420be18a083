"""The planner against what an H200 measured: ``benchmarks/results/gpu_h200.json`` holds each job's in-step peak
(``torch.cuda.max_memory_allocated``, the largest timed step's, from ``benchmarks/gpu.py``), and the estimate of the
same job must land within 1% of it (issue 19 asks 15%). The jobs cover eager full recompute, ``train.compile``
with and without recompute (inductor's blocks and the compiled loss), optimizer and activation offload and the
foreach optimizer. The planner before these measurements was off by +55% to +62% under compile and -19.6% with
activation offload; this fails on it. Runs on a CPU: it rebuilds each job's spec and estimates it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.gpu import build_spec
from orchestrator.planning.estimate import estimate_rank

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu_h200.json"
RUNS = json.loads(RESULTS.read_text())["runs"]


@pytest.mark.parametrize("run", RUNS, ids=[f"{r['call']}: {' '.join(r['overrides']) or 'default'}" for r in RUNS])
def test_the_estimate_is_within_one_percent_of_the_h200(run):
    spec = build_spec(run["overrides"], "cuda", "unused", 10)
    predicted, measured = estimate_rank(spec, 0).total_bytes, run["measured_peak_bytes"]
    assert abs(predicted - measured) / measured < 0.01, (predicted / 2**30, measured / 2**30)


def test_the_measurements_cover_compile_and_offload():
    """The file is the one the README cites (a job dropped from it would silently leave its term unchecked)."""
    seen = {" ".join(r["overrides"]) for r in RUNS}
    assert {"", "train.compile=true", "train.compile=true memory.recompute=none", "memory.offload.optimizer=true",
            "memory.offload.activations=true"} <= seen
