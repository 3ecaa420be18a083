"""MoE against dense at equal active parameters, and expert parallelism's step time (EP=1 against EP=2/4).

Four jobs train the same data for the same steps on the same 4 data-parallel ranks (gloo, the Ray-free parity
harness's spawned processes, one spawn for all four so they share the machine's state):

- ``dense``: a GPT whose feed-forward is ``d_ff`` wide;
- ``moe-ep1``, ``moe-ep2``, ``moe-ep4``: the same GPT with an MoE feed-forward in every block, ``experts``
  experts of width ``d_ff / top_k`` and top-k routing, so each token passes as many feed-forward parameters as
  in the dense model (equal active parameters) while the model holds ``experts / top_k`` times more; the
  experts split over 1, 2 and 4 ranks.

Reported per job: the loss after the same tokens (mean of the last 5 steps) and the median step time of the
slowest rank after warm-up, with ratios against ``dense`` and ``moe-ep1`` measured in the same run.

    python benchmarks/moe.py --data data/stdlib --steps 40 --out benchmarks/results/moe_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.pipedream import write_rows  # noqa: E402
from tests.support.jobs import tiny_spec  # noqa: E402
from tests.support.parity_harness import run_layouts  # noqa: E402

WARMUP, LAST = 3, 5
MODEL = {"d_model": 64, "n_layers": 4, "n_heads": 4, "seq_len": 64}


def jobs(d_ff: int, experts: int, top_k: int) -> dict[str, tuple[dict, dict]]:
    """name -> (model fields, parallel fields) over the shared model and 4 data-parallel ranks."""
    moe = {"experts": experts, "top_k": top_k, "router": "topk", "d_expert": d_ff // top_k}
    return {
        "dense": ({"d_ff": d_ff}, {"dp": 4}),
        **{f"moe-ep{ep}": ({"d_ff": d_ff, "moe": moe}, {"dp": 4, "ep": ep}) for ep in (1, 2, 4)},
    }


def measure(data: Path, steps: int, d_ff: int, experts: int, top_k: int) -> dict[str, dict]:
    specs, tmp = {}, Path(tempfile.mkdtemp(prefix="moe-bench-"))
    for name, (model, parallel) in jobs(d_ff, experts, top_k).items():
        specs[name] = tiny_spec(data, tmp / name, model={**MODEL, **model}, parallel={**parallel, "device": "cpu"},
                                train={"steps": steps, "global_batch_size": 16, "microbatches": 1},
                                optim={"lr": 3e-3})
    runs = run_layouts([s.worker_dict() for s in specs.values()], 4, steps, timeout_s=1800)
    rows = {}
    for name, run in zip(specs, runs):
        rows[name] = {"loss": statistics.fmean(run.losses[-LAST:]), "step_s": statistics.median(run.step_s[WARMUP:]),
                      "tokens": steps * 16 * MODEL["seq_len"]}
    for name, row in rows.items():
        row["step_vs_dense"] = row["step_s"] / rows["dense"]["step_s"]
        if name.startswith("moe"):
            row["step_vs_ep1"] = row["step_s"] / rows["moe-ep1"]["step_s"]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="prepared token shards (default: the stdlib json package)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--d-ff", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.data is None:
        from workers.data.prepare import prepare_small_corpus

        args.data = prepare_small_corpus("moe-bench-data-")
    rows = measure(args.data, args.steps, args.d_ff, args.experts, args.top_k)
    for name, row in rows.items():
        extra = f"  {row['step_vs_ep1']:.2f}x ep1" if "step_vs_ep1" in row else ""
        print(f"{name:>8}: loss {row['loss']:.4f} after {row['tokens']} tokens, step {row['step_s'] * 1e3:.1f} ms "
              f"({row['step_vs_dense']:.2f}x dense){extra}")
    write_rows(args, rows)


if __name__ == "__main__":
    main()
