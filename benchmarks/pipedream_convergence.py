"""Do PipeDream's asynchronous schedules converge like synchronous training? Like for like, two-sided.

PipeDream updates a stage after every microbatch, so at the same learning rate it takes ``train.microbatches``
times as many optimizer steps per token as 1F1B of the same job, each on a batch that many times smaller:
against that job it comes out ahead (more updates) and says nothing about its staleness. The like-for-like
reference changes one thing, the weights a microbatch runs on: 1F1B (exact synchronous training, a flush per
step) whose step is one asynchronous update, i.e. ``global_batch_size`` = the sequences one update averages
(a microbatch of every replica for PipeDream, ``pp_2bw_every`` of them for 2BW), at the same learning rate, for
as many steps as updates, so the same tokens in the same order. The check: the asynchronous loss over the
last tokens is within 5% of that reference's, either way. 1F1B of the unchanged job is printed beside it.

    python benchmarks/pipedream_convergence.py --steps 60 --out benchmarks/results/pipedream_convergence.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.pipedream import job, parse_args, write_rows  # noqa: E402
from orchestrator import JobSpec  # noqa: E402
from tests.support.parity_harness import run_layouts  # noqa: E402

TOLERANCE, LAST_STEPS = 0.05, 5  # the loss: mean over the tokens of the example's last 5 steps


def per_update(spec: JobSpec) -> int:
    """Sequences one optimizer update of ``spec`` averages (over its dp replicas)."""
    p, t = spec.parallel, spec.train
    if p.pp_schedule == "pipedream":
        return t.global_batch_size // t.microbatches
    if p.pp_schedule == "pipedream_2bw":
        return t.global_batch_size // t.microbatches * (p.pp_2bw_every or t.microbatches)
    return t.global_batch_size


def synchronous_twin(spec: JobSpec, run_dir: Path, steps: int) -> tuple[JobSpec, int]:
    """1F1B of ``spec`` with one step per asynchronous update (same tokens, order and lr), and its step count."""
    batch, pp = per_update(spec), spec.parallel.pp
    scale = spec.train.global_batch_size // batch
    raw = spec.to_dict()
    raw["parallel"] = {"pp": pp, "dp": spec.parallel.dp, "device": spec.parallel.device}
    raw["train"] = {**raw["train"], "global_batch_size": batch, "microbatches": pp, "steps": steps * scale}
    raw["run_dir"] = str(run_dir)
    return JobSpec.from_dict(raw), steps * scale


def last_loss(losses: list[float], steps: int) -> float:
    """Mean loss over the last ``LAST_STEPS`` of ``steps`` example steps' tokens (``losses`` at any batch)."""
    per_step = len(losses) // steps
    return statistics.fmean(losses[-LAST_STEPS * per_step:])


def measure(data: Path, steps: int, depths: tuple[int, ...], lr: float | None) -> dict[str, dict]:
    tmp, rows = Path(tempfile.mkdtemp(prefix="pipedream-conv-")), {}
    for pp in depths:
        def at_lr(spec: JobSpec) -> JobSpec:
            return spec.with_overrides([f"optim.lr={lr}"]) if lr else spec
        same_job = at_lr(job(data, tmp / f"pp{pp}-1f1b", pp, "1f1b", steps))
        asyncs = {s: at_lr(job(data, tmp / f"pp{pp}-{s}", pp, s, steps)) for s in ("pipedream", "pipedream_2bw")}
        runs = run_layouts([s.worker_dict() for s in [same_job, *asyncs.values()]], pp, steps, timeout_s=1800)
        base = last_loss(runs[0].losses, steps)
        for (schedule, spec), run in zip(asyncs.items(), runs[1:]):
            twin, twin_steps = synchronous_twin(spec, tmp / f"pp{pp}-{schedule}-sync", steps)
            ref = run_layouts([twin.worker_dict()], pp, twin_steps, timeout_s=1800)[0]
            loss, sync = last_loss(run.losses, steps), last_loss(ref.losses, steps)
            rows[f"pp{pp}-{schedule}"] = {"lr": spec.optim.lr, "loss": loss, "sync_batch": per_update(spec),
                                          "sync_loss": sync, "vs_sync": loss / sync - 1,
                                          "job_1f1b_loss": base, "vs_job_1f1b": loss / base - 1}
    return rows


def main(argv: list[str] | None = None) -> None:
    def lr_option(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--lr", type=float, help="optim.lr for every run (default: the example's)")

    args = parse_args(__doc__.splitlines()[0], argv, "pipedream-conv-data-", lr_option)
    rows = measure(args.data, args.steps, tuple(args.depths), args.lr)
    for name, r in rows.items():
        print(f"{name:>18} lr {r['lr']:.2e}: loss {r['loss']:.4f}; 1f1b at {r['sync_batch']} sequences a step "
              f"{r['sync_loss']:.4f} ({r['vs_sync']:+.1%}); 1f1b of the job {r['job_1f1b_loss']:.4f} "
              f"({r['vs_job_1f1b']:+.1%})")
    write_rows(args, rows)
    off = {n: f"{r['vs_sync']:+.1%}" for n, r in rows.items() if abs(r["vs_sync"]) > TOLERANCE}
    if off:
        raise SystemExit(f"asynchronous loss more than {TOLERANCE:.0%} from synchronous training at the same batch "
                         f"per update, lr and tokens: {off}")


if __name__ == "__main__":
    main()
