"""Seconds and bytes of parameter-server resizes (``parameter_server.resize``) as the controller runs them.

Real shard actors on a local Ray (run it under the integration lock): ``PSShards`` starts them, one worker
registers ``--tensors`` fp32 tensors of 1M elements and takes one AdamW step (so every chunk carries its two
moments), then the shard count goes 2 -> 3 -> 4 -> 3 -> 2 through ``ps_resize.resize``, the code a job runs
between steps (the workers' reshard call is left out: no ranks here). Each row is the record the summary's
``ps_resizes`` carries, with the share of chunk copies moved.

    python benchmarks/ps_resize.py --tensors 16 --out benchmarks/results/ps_resize.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray
import torch

from orchestrator.runtime import ps_resize
from orchestrator.runtime.ps_shards import PSShards
from orchestrator.spec import JobSpec
from parameter_server.client import PSClient, RayConn

COUNTS = (3, 4, 3, 2)  # from 2 shards


class NoRanks:
    """The rank group a resize reroutes; a benchmark without ranks has nobody to tell."""

    def __init__(self):
        self.worker_extra: dict = {}

    def call(self, method: str, *args) -> list:
        return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=16, help="tensors of 1M fp32 elements")
    parser.add_argument("--chunk-elems", type=int, default=65536)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    spec = JobSpec.from_dict({"data": {"path": "unused"}, "parallel": {"dp": 1, "dp_sync": "ps"},
                              "optim": {"name": "adamw", "grad_clip": 0.0}, "train": {"steps": 2},
                              "parameter_server": {"shards": 2, "chunk_elems": args.chunk_elems}})
    ray.init(num_cpus=2, include_dashboard=False)
    with tempfile.TemporaryDirectory() as run_dir:
        shards = PSShards(spec, Path(run_dir))
        client = PSClient([RayConn(h) for h in shards.handles], args.chunk_elems, 64, worker=0)
        params = {f"stage0.w{i}": torch.randn(1024, 1024) for i in range(args.tensors)}
        client.register(params)
        client.push(0, {n: torch.randn_like(p) for n, p in params.items()})
        client.apply(0, 1.0)
        rows = [ps_resize.resize(shards, count, NoRanks(), step=i) for i, count in enumerate(COUNTS)]
        shards.stop()
    ray.shutdown()
    for row in rows:
        row["share_of_copies_moved"] = round(row["chunks_moved"] / (2 * row["chunks"]), 4)
        row["seconds"] = round(row["seconds"], 3)
    out = {"parameters": args.tensors * 2**20, "chunk_elems": args.chunk_elems, "optimizer": "adamw",
           "resizes": rows}
    print(json.dumps(out, indent=2))
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
