"""ZeRO-R's memory measures (seed 004 lines 97-101 and 215-222), each against its baseline in the same run.

``pa``: partitioned activation checkpoints. The GPT of ``benchmarks/memory.py``'s ``activations`` profile at tp=2
without sequence parallelism under full recompute, on 2 Ray-free gloo ranks (the parity harness), with
``memory.measure``: the bytes saved for backward that stay on the device (``activations``) and the in-step peak
(``step_peak``), whole inputs against ``memory.partition_activations`` device and host; the host bytes Pa+cpu
keeps; each row's losses, which must equal the baseline's.

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
PA = {"whole": "none", "device": "device", "host": "host"}


def pa_rows(data: str, tmp: str, steps: int) -> dict:
    """Rank 0's measured bytes per ``PA`` setting after ``steps`` steps, with ratios to whole inputs."""
    specs = [JobSpec.from_dict({"name": "zero-r-pa", "run_dir": f"{tmp}/{name}", "data": {"path": data},
                                "model": MODEL, "parallel": {"tp": 2, "sequence_parallel": False, "device": "cpu"},
                                "memory": {"recompute": "full", "partition_activations": place, "measure": True},
                                "train": {"steps": steps, "global_batch_size": 16, "microbatches": 1}})
             for name, place in PA.items()]
    runs = dict(zip(PA, run_layouts([s.worker_dict() for s in specs], 2, steps), strict=True))
    base = runs["whole"].memory[0]
    rows = {}
    for name, run in runs.items():
        mem = run.memory[0]
        rows[name] = {"activations": mem["activations"], "activations_host": mem.get("activations_host", 0),
                      "step_peak": mem["step_peak"], "activations_ratio": mem["activations"] / base["activations"],
                      "step_peak_ratio": mem["step_peak"] / base["step_peak"],
                      "stored_saving_bytes": base["activations"] - mem["activations"],
                      "step_s": statistics.median(run.step_s[1:]), "losses": run.losses,
                      "losses_equal_whole": run.losses == runs["whole"].losses}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "zero_r.json"))
    args = ap.parse_args()
    data = str(Path(args.data).resolve())
    with tempfile.TemporaryDirectory(prefix="raymesh-zero-r-") as tmp:
        report = {"model": MODEL, "steps": args.steps, "pa": pa_rows(data, tmp, args.steps)}
    for name, row in report["pa"].items():
        print(f"pa {name:8} device {row['activations'] / 2**20:8.2f} MiB ({row['activations_ratio']:.3f})  host "
              f"{row['activations_host'] / 2**20:7.2f} MiB  step peak {row['step_peak'] / 2**20:8.2f} MiB "
              f"({row['step_peak_ratio']:.3f})  step {row['step_s']:.3f} s", flush=True)
    write_result(args.out, report, args.data)


if __name__ == "__main__":
    main()
