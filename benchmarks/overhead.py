"""raymesh's overhead against a plain ``torchrun`` script training the same FSDP2 model.

Both run in this one script, one after the other, on the same machine, so the
ratio is meaningful even where absolute times are noisy. Reports the median
step-time ratio (raymesh ÷ torchrun, first steps dropped as warm-up) and each
side's start-up seconds (launch to first step).

    python benchmarks/overhead.py --data data/stdlib --ranks 4 --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root
from benchmarks.provenance import write_result

WARMUP = 3


def run_torchrun(args) -> dict:
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
         str(Path(__file__).with_name("torchrun_baseline.py")), "--data", args.data, "--steps", str(args.steps)],
        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"startup_s": out["ready_unix"] - t0, "step_s": statistics.median(out["step_time_s"][WARMUP:])}


def run_raymesh(args) -> dict:
    from orchestrator import JobSpec, TrainingJob

    spec = JobSpec.from_dict({
        "name": "overhead-bench",
        "model": {"d_model": 64, "n_layers": 4, "n_heads": 4, "seq_len": 64},
        "data": {"path": str(Path(args.data).resolve())},
        "parallel": {"dp": args.ranks, "zero": 3, "device": "cpu"},
        "optim": {"lr": 3e-3},
        "train": {"steps": args.steps, "global_batch_size": 16, "microbatches": 1},
    })
    result = TrainingJob(spec, progress=False).run()
    return {"startup_s": result.startup_s, "step_s": statistics.median(result.step_time_s[WARMUP:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/overhead.json")
    args = ap.parse_args()
    baseline = run_torchrun(args)
    ours = run_raymesh(args)
    report = {
        "ranks": args.ranks, "steps": args.steps, "torchrun": baseline, "raymesh": ours,
        "step_time_ratio": ours["step_s"] / baseline["step_s"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, report, args.data)
    print(f"{'':10}{'startup s':>12}{'median step s':>16}")
    for name in ("torchrun", "raymesh"):
        print(f"{name:10}{report[name]['startup_s']:>12.2f}{report[name]['step_s']:>16.4f}")
    print(f"step-time ratio raymesh/torchrun: {report['step_time_ratio']:.3f}")


if __name__ == "__main__":
    main()
