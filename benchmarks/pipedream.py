"""PipeDream, PipeDream-2BW and 1F1B (PipeDream-flush) on the same job at pp=2 and pp=4, in one run.

Each layout trains the job of ``examples/pipedream.yaml`` (its model, batch and learning rate; only
``pp_schedule`` and ``pp`` change, dp=1) on spawned ranks over gloo (``tests/support/parity_harness.py``, no
Ray), one spawn per pipeline depth for its schedules. The asynchronous schedules run twice: as they run by
default, their steady state carried across step boundaries, and with ``pp_flush_per_step`` (``-flush`` rows),
draining at every step end. Reported per layout:

- throughput: tokens per second from the median step time of the slowest rank after warm-up;
- measured bubble: the idle share of each step's window per pp rank (``orchestrator.planning.bubble``), median;
- weight versions: the most versions a stage held stashed besides its live weights, and the bytes of one
  version of the largest stage (from the timeline's ``stashed``/``stash_bytes``);
- loss after the same tokens (mean of the last 5 steps), and its ratio to 1F1B's at the same depth; the run
  fails if an asynchronous schedule ends more than 5% above 1F1B (the convergence check of issue 18).

    python benchmarks/pipedream.py --steps 60 --out benchmarks/results/pipedream.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import write_result  # noqa: E402
from orchestrator import JobSpec  # noqa: E402
from orchestrator.planning.bubble import measured_bubble, step_events  # noqa: E402
from tests.support.parity_harness import run_layouts  # noqa: E402

WARMUP, LAST, TOLERANCE = 3, 5, 0.05
# name -> (pp_schedule, pp_flush_per_step)
SCHEDULES = {"1f1b": ("1f1b", False), "pipedream": ("pipedream", False), "pipedream_2bw": ("pipedream_2bw", False),
             "pipedream-flush": ("pipedream", True), "pipedream_2bw-flush": ("pipedream_2bw", True)}
EXAMPLE = ROOT / "examples" / "pipedream.yaml"


def job(data: Path, run_dir: Path, pp: int, name: str, steps: int) -> JobSpec:
    """The example's job at depth ``pp`` under schedule ``name`` (the schedule's own fields dropped elsewhere)."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    schedule, flush = SCHEDULES[name]
    parallel = {"pp": pp, "dp": 1, "pp_schedule": schedule, "device": "cpu"}
    if flush:
        parallel["pp_flush_per_step"] = True
    if schedule == "pipedream":
        parallel["pp_vertical_sync"] = raw["parallel"].get("pp_vertical_sync", False)
    raw.update(parallel={**parallel}, data={"path": str(data)}, run_dir=str(run_dir),
               metrics={"timeline": True}, checkpoint={"every": 0})
    raw["train"] = {**raw["train"], "steps": steps}
    return JobSpec.from_dict(raw)


def row(run, tokens_per_step: int) -> dict:
    timeline = [e for steps in run.results.values() for s in steps for e in s["timeline"]]
    steps = sorted({e["step"] for e in timeline})[WARMUP:]
    step_s = statistics.median(run.step_s[WARMUP:])
    pipeline = [e for e in timeline if e["kind"] in ("F", "B")]
    return {
        "tokens_per_s": tokens_per_step / step_s,
        "step_s": step_s,
        "bubble": statistics.median(measured_bubble(step_events(timeline, s)) for s in steps),
        "stashed_versions": max((e.get("stashed", 0) for e in pipeline), default=0),
        "bytes_per_version": max((e["stash_bytes"] // e["stashed"] for e in pipeline if e.get("stashed")), default=0),
        "loss": statistics.fmean(run.losses[-LAST:]),
    }


def measure(data: Path, steps: int, depths: tuple[int, ...]) -> dict[str, dict]:
    tmp, rows = Path(tempfile.mkdtemp(prefix="pipedream-bench-")), {}
    for pp in depths:
        specs = [job(data, tmp / f"pp{pp}-{s}", pp, s, steps) for s in SCHEDULES]
        tokens = specs[0].train.global_batch_size * specs[0].model.seq_len
        runs = run_layouts([s.worker_dict() for s in specs], pp, steps, timeout_s=1800)
        for schedule, run in zip(SCHEDULES, runs, strict=True):
            rows[f"pp{pp}-{schedule}"] = row(run, tokens)
        base = rows[f"pp{pp}-1f1b"]
        for schedule in SCHEDULES:
            r = rows[f"pp{pp}-{schedule}"]
            r["throughput_vs_1f1b"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["loss_vs_1f1b"] = r["loss"] / base["loss"]
    return rows


def parse_args(description: str, argv: list[str] | None, data_prefix: str, extra=None) -> argparse.Namespace:
    """The PipeDream benchmarks' shared options (``extra`` adds a script's own); the default corpus is prepared
    into a temporary directory named by ``data_prefix``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data", type=Path, help="prepared token shards (default: the stdlib json package)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", type=Path)
    if extra:
        extra(parser)
    args = parser.parse_args(argv)
    if args.data is None:
        from workers.data.prepare import prepare_small_corpus

        args.data = prepare_small_corpus(data_prefix)
    return args


def write_rows(args: argparse.Namespace, rows: dict) -> None:
    """The rows, with the arguments that produced them, to ``--out`` when given."""
    if args.out:
        write_result(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, args.data)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv, "pipedream-bench-data-")
    rows = measure(args.data, args.steps, tuple(args.depths))
    for name, r in rows.items():
        print(f"{name:>20}: {r['tokens_per_s']:8.0f} tok/s ({r['throughput_vs_1f1b']:.2f}x 1f1b), bubble "
              f"{r['bubble']:.1%}, {r['stashed_versions']} stashed version(s) of {r['bytes_per_version'] / 2**10:.0f} "
              f"KiB, loss {r['loss']:.4f} ({r['loss_vs_1f1b']:.3f}x 1f1b)")
    write_rows(args, rows)
    worse = {n: r["loss_vs_1f1b"] for n, r in rows.items() if r["loss_vs_1f1b"] > 1 + TOLERANCE}
    if worse:
        raise SystemExit(f"asynchronous schedules more than {TOLERANCE:.0%} above 1f1b's loss: {worse}")


if __name__ == "__main__":
    main()
