"""Parameter-server benchmarks, each a ratio against a baseline measured in the same run.

1. Transport: push+pull MB/s of a model-sized set of float32 tensors (one
   client, SGD on the shards so the server's update is cheap) with 1, 2 and 4
   shards, over Ray actor calls and over gRPC; ratio against 1 shard on the same
   transport.
2. Consistency: training throughput (samples/s, one global batch per step in
   every mode) of BSP, SSP and ASP with dp=4, with no straggler and with rank 1
   slowed 3x (``slow_rank``), and the loss after the same number of samples
   (mean of the last 3 steps); ratios against BSP under the same condition.

    python benchmarks/ps.py --data data/stdlib
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root
from benchmarks.provenance import provenance, write_result

WARMUP = 2
SGD = {"name": "sgd", "lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.95], "momentum": 0.0}


def transport_mb_s(shards: int, transport: str, numel: int, reps: int) -> float:
    from parameter_server.client import PSClient, RayConn
    from parameter_server.grpc_service import GrpcConn
    from parameter_server.shard import PSShard

    actors = [ray.remote(PSShard).options(max_concurrency=16, num_cpus=0).remote(i, "asp", SGD, 1, [SGD["lr"]])
              for i in range(shards)]
    token = "benchmark"
    conns = ([GrpcConn(a, token) for a in ray.get([h.serve_grpc.remote(token) for h in actors])]
             if transport == "grpc" else [RayConn(h) for h in actors])
    client = PSClient(conns, chunk_elems=1 << 18, vnodes=64, worker=0)
    params = {f"layer{i}": torch.randn(numel // 8) for i in range(8)}
    client.register(params)
    grads = {n: torch.randn_like(t) for n, t in params.items()}
    times = []
    for clock in range(WARMUP + reps):
        t0 = time.perf_counter()
        client.push(clock, grads)
        client.pull(list(params))
        times.append(time.perf_counter() - t0)
    for h in actors:
        ray.kill(h)
    megabytes = 2 * numel * 4 / 1e6  # pushed and pulled once each
    return megabytes / statistics.median(times[WARMUP:])


def training(args, consistency: str, straggler: bool) -> dict:
    from orchestrator import JobSpec, TrainingJob

    spec = JobSpec.from_dict({
        "name": f"ps-bench-{consistency}-{'slow' if straggler else 'even'}",
        "run_dir": f"/tmp/ps-bench/{consistency}-{straggler}",
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64},
        "data": {"path": str(Path(args.data).resolve())},
        "parallel": {"dp": 4, "dp_sync": "ps", "device": "cpu"},
        "parameter_server": {"shards": 2, "consistency": consistency, "staleness": 2},
        "optim": {"lr": 3e-3},
        "train": {"steps": args.steps, "global_batch_size": 16},
        "checkpoint": {"memory_every": 0},
        "faults": [{"kind": "slow_rank", "rank": 1, "at_step": 1, "factor": 3.0}] if straggler else [],
    })
    result = TrainingJob(spec, progress=False).run()
    samples = spec.train.global_batch_size * (args.steps - WARMUP)
    return {"samples_per_s": samples / sum(result.step_time_s[WARMUP:]),
            "loss_after_same_samples": statistics.fmean(result.losses[-3:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--numel", type=int, default=4 << 20, help="float32 elements pushed and pulled per step")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/ps.json")
    ap.add_argument("--parts", default="transport,consistency", help="which parts to run (comma-separated)")
    args = ap.parse_args()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)  # dp=4 ranks + driver-side clients
    out = Path(args.out)
    report: dict = json.loads(out.read_text()) if out.is_file() else {}  # a part run alone keeps the other's
    for stale in ("numel", "steps"):  # an older layout's run-wide arguments: each part names its own now
        report.pop(stale, None)
    out.parent.mkdir(parents=True, exist_ok=True)
    for part, measure, used in (("transport", transport_report, ("numel", "reps")),
                                ("consistency", consistency_report, ("steps",))):
        if part in args.parts:  # the part's own arguments and provenance, so one kept from an older run says so
            report[part] = {**measure(args), "args": {a: getattr(args, a) for a in used},
                            "provenance": provenance(args.data if part == "consistency" else None)}
            write_result(out, report)  # the corpus is in the part that read it
    print(json.dumps(report, indent=2))


def transport_report(args) -> dict:
    report = {}
    for transport in ("ray", "grpc"):
        rates = {n: transport_mb_s(n, transport, args.numel, args.reps) for n in (1, 2, 4)}
        report[transport] = {
            f"{n}_shards": {"mb_per_s": r, "ratio_vs_1_shard": r / rates[1]} for n, r in rates.items()}
    return report


def consistency_report(args) -> dict:
    report = {}
    for straggler in (False, True):
        runs = {c: training(args, c, straggler) for c in ("bsp", "ssp", "asp")}
        bsp = runs["bsp"]
        report["straggler" if straggler else "no_straggler"] = {
            c: {**r, "throughput_ratio_vs_bsp": r["samples_per_s"] / bsp["samples_per_s"],
                "loss_ratio_vs_bsp": r["loss_after_same_samples"] / bsp["loss_after_same_samples"]}
            for c, r in runs.items()}
    return report


if __name__ == "__main__":
    main()
