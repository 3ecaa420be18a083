"""Hybrid sharding (``parallel.dp_shard``) and the bf16 gradient reduction (``parallel.grad_reduce_dtype``):
bytes counted per mesh dimension on a tiny job, and the planner's predicted step of a Llama 3 8B shape on 1,024 H100.

1. Counted: the tiny GPT at dp=4 under ZeRO-3 (rank 0's ``metrics.comm_bytes`` in the second step, Ray-free
   ranks over gloo), plain against dp_shard=2 and dp_shard=2 with the bf16 reduction; ratios to plain.
2. Predicted: Llama 3 8B's shape (32 layers, h 4096, 8 KV heads, 8K tokens, 1,024 sequences a step) at dp=1024,
   ZeRO-3 (FSDP2's bf16 policy), on 8-GPU H100 nodes, at dp_shard 1024..1: the dp rows' bytes and the exposed
   dp time (shard groups of 8 or fewer stay on NVLink; the replicas' all-reduce crosses InfiniBand).

    python benchmarks/hybrid_sharding.py --data data/stdlib --out benchmarks/results/hybrid_sharding.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import write_result
from orchestrator import JobSpec
from orchestrator.planning import layout_search as ls
from orchestrator.planning import time_model as tm
from tests.support.parity_harness import run_layouts

TINY = {"d_model": 32, "n_layers": 4, "n_heads": 4, "d_ff": 64, "seq_len": 32}
COUNTED = {"zero3": {}, "zero3-dp_shard2": {"dp_shard": 2}, "zero3-dp_shard2-bf16": {"dp_shard": 2,
                                                                                      "grad_reduce_dtype": "bf16"}}


def counted(data: str, tmp: str) -> dict:
    """Rank 0's bytes per mesh dimension in step 2 of each ``COUNTED`` layout, and their sum's ratio to plain."""
    specs = [JobSpec.from_dict({"name": "hsdp-bench", "run_dir": f"{tmp}/{name}", "data": {"path": data},
                                "model": TINY, "parallel": {"dp": 4, "zero": 3, "device": "cpu", **par},
                                "train": {"steps": 2, "global_batch_size": 8, "microbatches": 2},
                                "metrics": {"comm_bytes": True}}) for name, par in COUNTED.items()]
    runs = run_layouts([s.worker_dict() for s in specs], 4, 2)
    rows = {name: run.field("comm_bytes")[0][-1] for name, run in zip(COUNTED, runs, strict=True)}
    plain = sum(rows["zero3"].values())
    return {name: {"bytes": row, "total_vs_plain": sum(row.values()) / plain} for name, row in rows.items()}


LLAMA_8B = ls.Shape(32, 4096, 32, 14336, 128256, 8192, 1024, kv_heads=8, arch="llama", fsdp_policy=True)


def predicted(zero: int) -> list[dict]:
    """The 8B shape at dp=1024 for each dp_shard: the dp rows' bytes, the exposed dp time and the state per rank."""
    ev = ls.Evaluator(LLAMA_8B, tm.gpu("H100"))
    out = []
    for shard in (None, 64, 8, 1):
        lay = ls.Layout(1024, 1, 1, 1, zero, 1, "none", dp_shard=shard)
        time, by_dim = ev.step_time(lay)
        out.append({"dp_shard": shard or 1024, "dp_bytes": {k: v for k, v in by_dim.items() if k.startswith("dp")},
                    "dp_exposed_s": time.exposed["dp"], "step_s": time.total, "peak_bytes": ev.peak(lay)[0]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--out", default="benchmarks/results/hybrid_sharding.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {"counted_dp4_tiny": counted(args.data, tmp), "predicted_llama3_8b_dp1024_zero3": predicted(3)}
    write_result(args.out, result, args.data)
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
