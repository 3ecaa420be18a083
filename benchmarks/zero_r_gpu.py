"""ZeRO-R's defragmentation measures on one GPU: the CUDA caching allocator's fragmentation with and without
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` and ``memory.contiguous_checkpoints``, against the default
allocator in the same run. UNRUN: written on a CPU-only machine (no CUDA allocator there to fragment); run it on
a GPU and quote its JSON.

    python benchmarks/zero_r_gpu.py --steps 6 --out benchmarks/results/zero_r_gpu.json

Each row trains the same job (a GPT of 24 blocks, d_model 2048, seq 2048, batch 4 in 2 microbatches, bf16, full
recompute; random token ids) in a fresh process, since the allocator's settings are read when CUDA starts. The
contiguous rows keep each block input as ``memory.partition_activations: device`` does (at tp 1 a copy of the
whole input) cut from one reused buffer, the others keep the inputs where autograd left them. ``--device cpu``
runs the same rows on a CPU (the code path only: there are no CUDA statistics), to check the script itself.
Figures from ``torch.cuda.memory_stats`` after the last step: peak reserved and peak allocated bytes and their gap
(what the allocator holds that no tensor uses: fragmentation), the bytes of inactive split blocks at the peak,
allocation retries (a cudaMalloc that failed, freed the cache and tried again: what fragmentation costs), and the
step time; ratios against the default allocator with whole inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from workers.data import write_token_rows  # noqa: E402

MODEL = {"d_model": 2048, "n_layers": 24, "n_heads": 16, "d_ff": 8192, "seq_len": 2048, "vocab_size": 32000}
STATS = ("reserved_bytes.all.peak", "allocated_bytes.all.peak", "inactive_split_bytes.all.peak",
         "num_alloc_retries", "segment.all.peak")
ROWS = {  # name: (PYTORCH_CUDA_ALLOC_CONF, memory.contiguous_checkpoints)
    "default": ("", False), "expandable_segments": ("expandable_segments:True", False),
    "contiguous_checkpoints": ("", True), "both": ("expandable_segments:True", True),
}


def job(steps: int, contiguous: bool, data: str, device: str, model: dict) -> dict:
    """The worker spec every row trains."""
    from orchestrator import JobSpec

    return JobSpec.from_dict({
        "name": "zero-r-gpu", "model": model, "data": {"path": data},
        "parallel": {"device": device}, "precision": {"dtype": "bf16" if device == "cuda" else "fp32"},
        "memory": {"recompute": "full", "partition_activations": "device" if contiguous else "none",
                   "contiguous_checkpoints": contiguous},
        "train": {"steps": steps, "global_batch_size": 4, "microbatches": 2}}).worker_dict()


def child(spec_path: str, steps: int) -> None:
    """One row, in its own process: train, then print the allocator's statistics as JSON."""
    import torch

    from workers.peak_memory_run import _rendezvous
    from workers.trainer import Trainer

    addr, port, listener = _rendezvous()
    trainer = Trainer(json.loads(Path(spec_path).read_text()), 0, 1, addr, port, listener=listener)
    step_s = [trainer.train_step().time_s.step for _ in range(steps)]
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else dict.fromkeys(STATS, 0)
    print(json.dumps({"reserved_peak": stats["reserved_bytes.all.peak"],
                      "allocated_peak": stats["allocated_bytes.all.peak"],
                      "inactive_split_peak": stats["inactive_split_bytes.all.peak"],
                      "alloc_retries": stats["num_alloc_retries"], "segments_peak": stats["segment.all.peak"],
                      "step_s": statistics.median(step_s[1:])}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/zero_r_gpu.json"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--child", nargs=2, metavar=("SPEC", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    model = MODEL if args.device == "cuda" else {**MODEL, "d_model": 64, "n_layers": 4, "n_heads": 4,
                                                  "d_ff": 256, "seq_len": 64, "vocab_size": 256}
    rows, work = {}, Path(args.out).with_suffix(".spec")
    data = str(Path(args.out).with_suffix(".tokens"))
    ids = np.random.default_rng(0).integers(0, model["vocab_size"], size=(args.steps + 1) * 4 * (model["seq_len"] + 1))
    write_token_rows([ids], Path(data), model["vocab_size"], "synthetic: uniform random ids, seed 0")
    for name, (conf, contiguous) in ROWS.items():
        work.write_text(json.dumps(job(args.steps, contiguous, data, args.device, model)))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTORCH_CUDA_ALLOC_CONF": conf}
        out = subprocess.run([sys.executable, __file__, "--child", str(work), str(args.steps)], env=env,
                             capture_output=True, text=True, check=True, cwd=ROOT)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["fragmentation_bytes"] = row["reserved_peak"] - row["allocated_peak"]
        rows[name] = row
        base = rows["default"]
        row["reserved_ratio"] = row["reserved_peak"] / max(1, base["reserved_peak"])
        row["step_time_ratio"] = row["step_s"] / base["step_s"]
        print(f"{name:24} reserved {row['reserved_peak'] / 2**30:6.2f} GiB ({row['reserved_ratio']:.3f})  "
              f"fragmentation {row['fragmentation_bytes'] / 2**20:8.1f} MiB  retries {row['alloc_retries']}",
              flush=True)
    work.unlink()
    shutil.rmtree(data)
    Path(args.out).write_text(json.dumps({"model": model, "device": args.device, "steps": args.steps, "rows": rows},
                                         indent=1) + "\n")


if __name__ == "__main__":
    main()
