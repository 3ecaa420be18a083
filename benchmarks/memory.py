"""Peak memory and step time of each ZeRO stage, offload tier and recompute policy, against zero=0.

Every configuration trains the same GPT for the same steps on the same data
parallel ranks, each in fresh processes (``torchrun`` running
``workers.peak_memory_run``), one after the other in this one script, so ratios
against the zero=0 row are meaningful where absolute figures are noisy. Peak
memory is the largest rank's peak (``torch.cuda.max_memory_allocated`` on a
GPU, peak RSS on CPU). All processes run with glibc's mmap threshold fixed
(``MALLOC_MMAP_THRESHOLD_``), as offloading workers set it themselves, so no
row's figure carries heap memory freed but kept by the allocator.

    python benchmarks/memory.py --data data/stdlib --ranks 2 --steps 8
    python benchmarks/memory.py --data data/stdlib --ranks 2 --steps 8 --profile activations
    python benchmarks/memory.py --data data/stdlib --ranks 2 --steps 8 \
        --only zero3 zero3+optim-offload-nvme zero3+param-offload-nvme \
        --out benchmarks/results/memory_param_offload.json

Two profiles, since a rank's peak comes from whichever dominates: ``state``
(a wide model, small batch: the peak is at the optimizer step, where ZeRO and
optimizer offload act) and ``activations`` (a small model, long sequences and
a big batch: the peak is at the end of forward, where recompute, activation
offload and compression act).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.provenance import write_result  # noqa: E402

WARMUP = 2
PROFILES = {  # model, global batch, configurations measured
    "state": ({"d_model": 384, "n_layers": 8, "n_heads": 6, "d_ff": 1536, "seq_len": 64}, 8, None),
    "activations": ({"d_model": 128, "n_layers": 4, "n_heads": 4, "d_ff": 512, "seq_len": 512}, 16,
                    ["zero3", "zero0+act-offload-nvme", "zero0+act-bf16", "zero0+act-fp8", "zero0+recompute-selective",
                     "zero0+recompute-full"]),
}


def configs(nvme: str) -> dict[str, dict]:
    """name -> job sections over the base job (zero 0, no offload, no recompute)."""
    off = {"tier": "nvme", "path": nvme}
    return {
        "zero0": {},
        "zero1": {"parallel": {"zero": 1}},
        "zero2": {"parallel": {"zero": 2}},
        "zero3": {"parallel": {"zero": 3}},
        "zero3+optim-offload-cpu": {"parallel": {"zero": 3}, "memory": {"offload": {"optimizer": True}}},
        "zero3+optim-offload-nvme": {"parallel": {"zero": 3}, "memory": {"offload": {"optimizer": True, **off}}},
        "zero3+param-offload-nvme": {"parallel": {"zero": 3},
                                     "memory": {"offload": {"optimizer": True, "params": True, **off}}},
        "zero0+paged_adamw-nvme": {"optim": {"name": "paged_adamw"}, "memory": {"offload": off}},
        "zero0+act-offload-nvme": {"memory": {"offload": {"activations": True, **off}}},
        "zero0+act-bf16": {"memory": {"activation_compression": "bf16"}},
        "zero0+act-fp8": {"memory": {"activation_compression": "fp8"}},
        "zero0+recompute-selective": {"memory": {"recompute": "selective"}},
        "zero0+recompute-full": {"memory": {"recompute": "full"}},
    }


def job(args, sections: dict):
    from orchestrator import JobSpec

    model, batch, _ = PROFILES[args.profile]
    raw = {"name": "memory-bench", "model": dict(model), "data": {"path": str(Path(args.data).resolve())},
           "parallel": {"dp": args.ranks, "device": args.device}, "optim": {"lr": 3e-3},
           "train": {"steps": args.steps, "global_batch_size": batch, "microbatches": 1}}
    for name, fields in sections.items():
        raw.setdefault(name, {}).update(fields)
    return JobSpec.from_dict(raw)


def measure(args, spec, workdir: Path) -> dict:
    path = workdir / "spec.json"
    path.write_text(json.dumps(spec.worker_dict()))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
         "-m", "workers.peak_memory_run", str(path), str(args.steps)],
        capture_output=True, text=True, check=True, env=env, cwd=ROOT,
    )
    ranks = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ranks),
        "offloaded_bytes": max(r["offloaded_bytes"] for r in ranks),
        "step_s": statistics.median(s for r in ranks for s in r["step_s"][WARMUP:]),
        "final_loss": next(r["losses"][-1] for r in ranks if r["rank"] == 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="state")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", nargs="*", help="run just these configurations (zero0 always runs)")
    ap.add_argument("--out", help="default: benchmarks/results/memory_<profile>.json")
    args = ap.parse_args()
    only = args.only or PROFILES[args.profile][2]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="raymesh-membench-") as tmp:
        for name, sections in configs(str(Path(tmp) / "nvme")).items():
            if only and name != "zero0" and name not in only:
                continue
            rows[name] = measure(args, job(args, sections), Path(tmp))
            base = rows["zero0"]
            rows[name]["memory_ratio"] = rows[name]["peak_memory_bytes"] / base["peak_memory_bytes"]
            rows[name]["step_time_ratio"] = rows[name]["step_s"] / base["step_s"]
            r = rows[name]
            print(f"{name:28}{r['peak_memory_bytes'] / 2**20:>10.1f} MiB {r['memory_ratio']:>7.3f}"
                  f"{r['step_s']:>9.3f} s {r['step_time_ratio']:>7.2f}"
                  f"  offloaded {r['offloaded_bytes'] / 2**20:.1f} MiB",
                  flush=True)
    model, batch, _ = PROFILES[args.profile]
    report = {"profile": args.profile, "ranks": args.ranks, "steps": args.steps, "global_batch_size": batch,
              "device": args.device, "model": model, "rows": rows}
    out = Path(args.out or ROOT / f"benchmarks/results/memory_{args.profile}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, report, args.data)


if __name__ == "__main__":
    main()
