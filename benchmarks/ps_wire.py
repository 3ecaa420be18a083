"""Bytes on the wire between one worker and the parameter-server shards per BSP step, for every
``parameter_server.compression`` kind, with an example job's model, chunk size and top-k ratio.

Ray-free: the shards are called in this process (``tests/support/ps_local.py``); the bytes are what
``PSClient.take_wire_bytes`` counts, the figure a step record carries as ``comm_bytes.ps`` (push payload to
both holders of each chunk, plus the pull). Random gradients: the bytes do not depend on their values.

    python benchmarks/ps_wire.py examples/parameter_server_compression.yaml --out benchmarks/results/ps_wire.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from orchestrator.spec.loading import load_spec
from parameter_server.client import PSClient
from parameter_server.shard import PSShard
from tests.support.ps_local import LocalConn
from workers.contract.compression_kinds import PS_KINDS
from workers.model.meta_init import build_full
from workers.model.registry import model_config
from workers.parallel.grad_compression import WireCodec


def step_bytes(params: dict, kind: str, ps, optim: dict) -> dict:
    """Push and pull bytes of one BSP step of one worker over ``ps.shards`` shards."""
    shards = [PSShard(i, "bsp", optim, 1, [optim["lr"]]) for i in range(ps.shards)]
    client = PSClient([LocalConn(s) for s in shards], ps.chunk_elems, ps.virtual_nodes, worker=0,
                      codec=WireCodec(kind, ps.topk_ratio))
    client.register(params)
    client.push(0, {n: torch.randn_like(p) for n, p in params.items()})
    client.apply(0, 1.0)
    push = client.take_wire_bytes()
    client.pull(list(params), 1)
    return {"push": push, "pull": client.take_wire_bytes()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", help="a job file with parallel.dp_sync: ps")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    spec = load_spec(args.job)
    model = build_full(model_config(spec.worker_dict()["model"]), spec.train.seed)
    params = {n: p.detach() for n, p in model.named_parameters()}
    optim = spec.parameter_server.server_optim(spec.optim)
    rows = {kind: step_bytes(params, kind, spec.parameter_server, optim) for kind in PS_KINDS}
    none = rows["none"]
    for row in rows.values():
        row["push_vs_none"] = round(row["push"] / none["push"], 4)
        row["total_vs_none"] = round((row["push"] + row["pull"]) / (none["push"] + none["pull"]), 4)
    out = {"job": args.job, "parameters": sum(p.numel() for p in params.values()),
           "shards": spec.parameter_server.shards, "chunk_elems": spec.parameter_server.chunk_elems,
           "topk_ratio": spec.parameter_server.topk_ratio, "per_step": rows}
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
