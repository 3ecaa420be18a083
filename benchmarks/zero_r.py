"""ZeRO-R's memory measures (seed 004 lines 97-101 and 215-222), each against its baseline in the same run.

``pa``: partitioned activation checkpoints. The GPT of ``benchmarks/memory.py``'s ``activations`` profile at tp=2
without sequence parallelism under full recompute, on 2 Ray-free gloo ranks (the parity harness), with
``memory.measure``: the bytes saved for backward that stay on the device (``activations``) and the in-step peak
(``step_peak``), whole inputs against ``memory.partition_activations`` device and host; the host bytes Pa+cpu
keeps; each row's losses, which must equal the baseline's. ``device+contiguous`` adds
``memory.contiguous_checkpoints`` (defragmentation): the buffers allocated for slices over the run
(``slice_allocations``: one per slice without it) is what a CPU can show; the fragmentation it and the
allocator's ``expandable_segments`` remove is a CUDA allocator figure, ``benchmarks/zero_r_gpu.py``.

``buckets``: constant-size communication buffers for ZeRO-3. ``memory.py``'s ``state`` profile's GPT (d_model 384,
seq 64, batch 8: parameters dominate the peak, which then sits in backward), with 8 layers, at dp=2 ZeRO-3 with
``memory.measure`` and ``metrics.comm_bytes``: one FSDP2 unit per block (the default) against
``parallel.fsdp_bucket_mb`` holding 2, 4 and all 8 blocks: the block all-gathers and reduce-scatters per step
and their buffer size (``fsdp_units`` on the model), the in-step peak, the bytes sent and the step time.

    python benchmarks/zero_r.py --data data/stdlib --out benchmarks/results/zero_r.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import write_result
from orchestrator import JobSpec
from tests.support.parity_harness import run_layouts

MODEL = {"d_model": 128, "n_layers": 4, "n_heads": 4, "d_ff": 512, "seq_len": 512}
PA = {"whole": ("none", False), "device": ("device", False), "host": ("host", False),
      "device+contiguous": ("device", True)}
BUCKET_MODEL = {"d_model": 384, "n_layers": 8, "n_heads": 6, "d_ff": 1536, "seq_len": 64}
BUCKETS = {"per-block": None, "2-blocks": 2, "4-blocks": 4, "all-8": 8}  # blocks a bucket holds


def pa_rows(data: str, tmp: str, steps: int) -> dict:
    """Rank 0's measured bytes per ``PA`` setting after ``steps`` steps, with ratios to whole inputs."""
    specs = [JobSpec.from_dict({"name": "zero-r-pa", "run_dir": f"{tmp}/{name}", "data": {"path": data},
                                "model": MODEL, "parallel": {"tp": 2, "sequence_parallel": False, "device": "cpu"},
                                "memory": {"recompute": "full", "partition_activations": place, "measure": True,
                                           "contiguous_checkpoints": contiguous},
                                "train": {"steps": steps, "global_batch_size": 16, "microbatches": 1}})
             for name, (place, contiguous) in PA.items()]
    runs = dict(zip(PA, run_layouts([s.worker_dict() for s in specs], 2, steps), strict=True))
    base = runs["whole"].memory[0]
    rows = {}
    for name, run in runs.items():
        mem = run.memory[0]
        rows[name] = {"activations": mem["activations"], "activations_host": mem.get("activations_host", 0),
                      "slice_allocations": mem.get("slice_allocations", 0),
                      "step_peak": mem["step_peak"], "activations_ratio": mem["activations"] / base["activations"],
                      "step_peak_ratio": mem["step_peak"] / base["step_peak"],
                      "stored_saving_bytes": base["activations"] - mem["activations"],
                      "step_s": statistics.median(run.step_s[1:]), "losses": run.losses,
                      "losses_equal_whole": run.losses == runs["whole"].losses}
    return rows


def _units(blocks_per_bucket: int | None) -> tuple[float | None, list[int]]:
    """The ``fsdp_bucket_mb`` that holds ``blocks_per_bucket`` blocks, and each unit's buffer bytes."""
    import torch

    from workers.model.gpt import GPT
    from workers.model.registry import model_config
    from workers.parallel.data_parallel import fsdp_units

    with torch.device("meta"):
        gpt = GPT(model_config({**BUCKET_MODEL, "vocab_size": 256}))
    blocks = list(gpt.layers.values())
    block = sum(p.numel() * 4 for p in blocks[0].parameters())
    bucket = None if blocks_per_bucket is None else (blocks_per_bucket + 0.5) * block / 2**20
    return bucket, [sum(p.numel() * 4 for b in unit for p in b.parameters()) for unit in fsdp_units(blocks, bucket)]


def bucket_rows(data: str, tmp: str, steps: int) -> dict:
    """Rank 0's in-step peak, bytes sent and step time per ``BUCKETS`` setting, with ratios to one unit a block."""
    units = {name: _units(n) for name, n in BUCKETS.items()}
    specs = [JobSpec.from_dict({"name": "zero-r-buckets", "run_dir": f"{tmp}/{name}", "data": {"path": data},
                                "model": BUCKET_MODEL,
                                "parallel": {"dp": 2, "zero": 3, "fsdp_bucket_mb": units[name][0], "device": "cpu"},
                                "memory": {"measure": True}, "metrics": {"comm_bytes": True},
                                "train": {"steps": steps, "global_batch_size": 8, "microbatches": 1}})
             for name in BUCKETS]
    runs = dict(zip(BUCKETS, run_layouts([s.worker_dict() for s in specs], 2, steps), strict=True))
    base = runs["per-block"]
    rows = {}
    for name, run in runs.items():
        sizes = units[name][1]
        peak, sent = run.memory[0]["step_peak"], sum(run.field("comm_bytes")[0][-1].values())
        rows[name] = {"fsdp_bucket_mb": units[name][0], "block_units": len(sizes), "buffer_bytes": max(sizes),
                      "block_all_gathers_per_step": 2 * len(sizes), "block_reduce_scatters_per_step": len(sizes),
                      "step_peak": peak, "step_peak_ratio": peak / base.memory[0]["step_peak"],
                      "sent_bytes": sent, "sent_ratio": sent / sum(base.field("comm_bytes")[0][-1].values()),
                      "step_s": statistics.median(run.step_s[1:]),
                      "step_time_ratio": statistics.median(run.step_s[1:]) / statistics.median(base.step_s[1:]),
                      "losses_equal_per_block": run.losses == base.losses}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "zero_r.json"))
    args = ap.parse_args()
    data = str(Path(args.data).resolve())
    with tempfile.TemporaryDirectory(prefix="raymesh-zero-r-") as tmp:
        report = {"model": MODEL, "bucket_model": BUCKET_MODEL, "steps": args.steps,
                  "pa": pa_rows(data, tmp, args.steps), "buckets": bucket_rows(data, tmp, args.steps)}
    for name, row in report["pa"].items():
        print(f"pa {name:8} device {row['activations'] / 2**20:8.2f} MiB ({row['activations_ratio']:.3f})  host "
              f"{row['activations_host'] / 2**20:7.2f} MiB  step peak {row['step_peak'] / 2**20:8.2f} MiB "
              f"({row['step_peak_ratio']:.3f})  allocations {row['slice_allocations']}  step {row['step_s']:.3f} s",
              flush=True)
    for name, row in report["buckets"].items():
        print(f"buckets {name:9} units {row['block_units']}  buffer {row['buffer_bytes'] / 2**20:6.2f} MiB  step peak "
              f"{row['step_peak'] / 2**20:8.2f} MiB ({row['step_peak_ratio']:.3f})  sent {row['sent_ratio']:.3f}  "
              f"step {row['step_s']:.3f} s ({row['step_time_ratio']:.2f})", flush=True)
    write_result(args.out, report, args.data)


if __name__ == "__main__":
    main()
