"""ZeRO-0 gradient communication: bucketed (overlapping backward) against one all-reduce after backward, and
the bytes and loss of every compression kind, all in one run on the same machine.

Ranks are spawned processes over gloo (``tests/support/parity_harness.py``, no Ray). Overlap comes from the
timeline each rank records (``metrics.timeline``): the share of the bucket reductions' time that falls inside
some microbatch's forward+backward (``workers.diagnostics.timeline.overlap_fraction``). Bytes are counted by
``metrics.comm_bytes`` (every collective issued, ring bytes sent by rank 0 per step).

    python benchmarks/communication.py --data data/stdlib --out benchmarks/results/communication.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import write_result
from orchestrator import JobSpec
from tests.support.parity_harness import run_layout
from workers.diagnostics.timeline import overlap_fraction

WARMUP = 2  # first steps dropped from the step time (allocation, first buckets)
# big enough that a gradient all-reduce costs milliseconds: ~6.4 M parameters, 25 MiB of fp32 gradients
OVERLAP_MODEL = {"d_model": 256, "n_layers": 8, "n_heads": 8, "d_ff": 1024, "seq_len": 64}
TINY_MODEL = {"d_model": 32, "n_layers": 4, "n_heads": 4, "d_ff": 64, "seq_len": 32}
COMPRESSION = {
    "none": ({}, {}),
    "bf16": ({"grad_compression": "bf16"}, {}),
    "fp16": ({"grad_compression": "fp16"}, {}),
    "powersgd": ({"grad_compression": "powersgd", "powersgd_rank": 4}, {}),  # its default 10-step warm-up
    "powersgd_no_warmup": ({"grad_compression": "powersgd", "powersgd_rank": 4, "powersgd_warmup_steps": 0}, {}),
    "topk": ({"grad_compression": "topk", "topk_ratio": 0.2}, {}),
    "onebit_adam": ({}, {"name": "onebit_adam", "warmup_steps": 100}),  # half of 200 steps: see the README
}


def _spec(data: str, run_dir: str, model: dict, steps: int, parallel: dict, optim: dict, batch: int) -> JobSpec:
    return JobSpec.from_dict({
        "name": "comm-bench", "run_dir": run_dir, "data": {"path": data}, "model": model,
        "parallel": {"dp": 2, "device": "cpu", **parallel}, "optim": {"lr": 3e-3, **optim},
        "train": {"steps": steps, "global_batch_size": batch, "microbatches": 2},
        "metrics": {"timeline": True, "comm_bytes": True}, "checkpoint": {"every": 0},
    })


def overlap(data: str, steps: int, bucket_mb: float, tmp: str) -> dict:
    """Median step time and overlap fraction over both ranks, first steps dropped."""
    spec = _spec(data, tmp, OVERLAP_MODEL, steps, {"bucket_mb": bucket_mb}, {}, 8)
    run = run_layout(spec.worker_dict(), 2, steps, timeout_s=1800)
    step_s, fractions, buckets = [], [], 0
    for results in (run.results or {}).values():
        for r in results[WARMUP:]:
            step_s.append(r["time_s"]["step"])
            comm = [e for e in r["timeline"] if e["kind"] == "allreduce"]
            buckets = len(comm)
            fractions.append(overlap_fraction(comm, [e for e in r["timeline"] if e["kind"] == "FB"]))
    return {"bucket_mb": bucket_mb, "buckets": buckets, "step_s": statistics.median(step_s),
            "overlap_fraction": statistics.fmean(fractions)}


def compression(data: str, steps: int, tmp: str) -> dict:
    """Per kind: bytes rank 0 sent over dp in the last step, and the mean loss of the last 10 steps."""
    out = {}
    for kind, (parallel, optim) in COMPRESSION.items():
        spec = _spec(data, tmp, TINY_MODEL, steps, parallel, optim, 8)
        run = run_layout(spec.worker_dict(), 2, steps, timeout_s=1800)
        out[kind] = {"dp_bytes_per_step": run.field("comm_bytes")[0][-1]["dp"],
                     "loss_last10": statistics.fmean(run.losses[-10:])}
        print(kind, out[kind], flush=True)
    base = out["none"]
    for row in out.values():
        row["bytes_ratio"] = base["dp_bytes_per_step"] / row["dp_bytes_per_step"]
        row["loss_vs_none"] = row["loss_last10"] / base["loss_last10"] - 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a prepared token directory (raymesh prepare-data)")
    ap.add_argument("--steps", type=int, default=10, help="steps per overlap run")
    ap.add_argument("--bucket-mb", type=float, default=2.0, help="the bucketed run's parallel.bucket_mb")
    ap.add_argument("--compression-steps", type=int, default=200, help="steps per compression run (0: skip)")
    ap.add_argument("--out", default="benchmarks/results/communication.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {"overlap": {"one_allreduce": overlap(args.data, args.steps, 0, tmp),
                              "bucketed": overlap(args.data, args.steps, args.bucket_mb, tmp)}}
        print(json.dumps(result, indent=2), flush=True)
        if args.compression_steps:
            result["compression"] = compression(args.data, args.compression_steps, tmp)
    write_result(args.out, result, args.data)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
