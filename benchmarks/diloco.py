"""DiLoCo against all-reduce at equal tokens: the loss it ends at and the data-parallel bytes it moves.

Both runs are the tiny test shape (as Llama) at dp=4 on the same seeded data, the same global batches in the same
order (each replica reads its dp share of every batch either way): ``dp_sync: allreduce`` averages gradients every
step; ``dp_sync: diloco`` with ``diloco_inner_steps`` H steps each replica's own AdamW and meets every H steps
(workers/step/diloco.py). As in DiLoCo's paper both start from a warmed-up model: ``--warm-steps`` of all-reduce
from scratch, exported and read back by ``model.init_from`` (fresh optimizers and schedule; the compared steps
read the data in another order). The default corpus is 2M tokens of the stdlib with 5% of its files held out, and
the loss compared is the final model's on those held-out files (the last round's training loss is reported too);
the bytes are ``metrics.comm_bytes``'s ``dp`` count summed over every rank and step of the compared runs.
Ray-free: the ranks are the parity harness's gloo processes.

    python benchmarks/diloco.py --out benchmarks/results/diloco.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import write_result  # noqa: E402
from orchestrator import JobSpec  # noqa: E402
from tests.support.jobs import TINY  # noqa: E402
from tests.support.parity_harness import LayoutRun, run_layouts  # noqa: E402
from workers.data.prepare import default_sources  # noqa: E402

TOLERANCE = 0.03  # DiLoCo's loss within 3% of all-reduce's (issue #51)


def job(data: Path, heldout: Path, run_dir: Path, steps: int, dp_sync: str, inner_steps: int, dp: int = 4,
        outer: dict | None = None, start: Path | None = None) -> JobSpec:
    """The tiny job at ``dp`` under ``dp_sync`` (H = ``inner_steps`` and the ``outer`` settings, e.g.
    ``{"diloco_outer_lr": 1.0}``, for diloco), counting collective bytes; from the weights in ``start`` (a Hugging
    Face directory, ``model.init_from``) with the data in another order than the warm-up's, or from scratch."""
    raw = {k: dict(v) for k, v in TINY.items()}
    raw["model"]["arch"] = "llama"  # the tiny shape as Llama, which export-hf writes and init_from reads back whole
    if start is not None:
        raw["model"]["init_from"] = str(start)
    raw["parallel"] = {"device": "cpu", "dp": dp, "dp_sync": dp_sync}
    if dp_sync == "diloco":
        raw["parallel"].update(diloco_inner_steps=inner_steps, **(outer or {}))
    raw["train"] = {**raw["train"], "steps": steps, "global_batch_size": 4 * dp, "microbatches": 1}
    raw["optim"] = {**raw["optim"], "schedule": "cosine", "warmup_steps": steps // 10}
    raw.update(data={"path": str(data), "seed": 0 if start is None else 1}, run_dir=str(run_dir),
               metrics={"comm_bytes": True}, checkpoint={"every": 0},
               eval={"path": str(heldout), "every": steps, "batches": 16})
    return JobSpec.from_dict(raw)


def dp_bytes(run: LayoutRun) -> int:
    """Every rank's data-parallel bytes over the run (``metrics.comm_bytes``'s ``dp`` count)."""
    return sum((c or {}).get("dp", 0) for counts in run.field("comm_bytes").values() for c in counts)


def warmed_up(data: Path, heldout: Path, tmp: Path, steps: int, dp: int) -> Path:
    """``steps`` of all-reduce training from scratch, exported as a Hugging Face directory: the start both compared
    runs share. Why: DiLoCo's paper starts its replicas from a pretrained model; from scratch, where every step
    moves the weights far, replicas that drift apart for H steps average to a worse model (measured: +5% at 160
    steps, +8% at 1280 on this model, where a warmed-up start leaves +2.4-2.9%)."""
    from workers.finetune import export_merged

    spec = job(data, heldout, tmp / "warm", steps, "allreduce", 1, dp)
    run_layouts([spec.worker_dict()], dp, steps, timeout_s=1800, checkpoints=[str(tmp / "warm-ckpt")])
    return export_merged(spec.worker_dict(), tmp / "warm-ckpt", tmp / "warm-hf", "hf")


def measure(data: Path, heldout: Path, steps: int, inner_steps: int, dp: int = 4, outer: dict | None = None,
            warm: int = 0) -> dict:
    """Both runs in one spawn of ``dp`` ranks (after ``warm`` all-reduce steps they both start from, when
    positive): the final model's held-out loss, the last round's training loss and the dp bytes of each, and the
    ratios."""
    tmp = Path(tempfile.mkdtemp(prefix="diloco-bench-"))
    start = warmed_up(data, heldout, tmp, warm, dp) if warm else None
    specs = [job(data, heldout, tmp / k, steps, k, inner_steps, dp, outer, start) for k in ("allreduce", "diloco")]
    runs = dict(zip(("allreduce", "diloco"), run_layouts([s.worker_dict() for s in specs], dp, steps,
                                                          timeout_s=1800)))
    final = {name: run.eval_losses[steps] for name, run in runs.items()}
    train = {name: statistics.fmean(run.losses[-inner_steps:]) for name, run in runs.items()}
    sent = {name: dp_bytes(run) for name, run in runs.items()}
    return {"steps": steps, "warm_steps": warm, "dp": dp, "inner_steps": inner_steps, "outer": outer or {},
            "tokens": steps * specs[0].train.global_batch_size * specs[0].model.seq_len,
            "loss": final, "loss_vs_allreduce": final["diloco"] / final["allreduce"] - 1,
            "train_loss_last_round": train, "train_loss_vs_allreduce": train["diloco"] / train["allreduce"] - 1,
            "dp_bytes": sent, "dp_bytes_per_step": {k: v / steps for k, v in sent.items()},
            "bytes_cut": sent["allreduce"] / sent["diloco"],
            "syncs": {"allreduce": steps, "diloco": steps // inner_steps}}


def stdlib_corpus() -> tuple[Path, Path]:
    """2M tokens of Python's standard library (``raymesh prepare-data``'s default source) and 5% of its files held
    out: the held-out loss is then the same kind of text the model trains on, and 160 steps read 4% of the
    corpus, so neither run repeats data (the stdlib's json package, 48k tokens, was read 1.7 times in 160 steps
    and scored on the html package)."""
    from workers.data import prepare_data

    out = Path(tempfile.mkdtemp(prefix="diloco-bench-data-"))
    prepare_data([default_sources()[0]], out, max_tokens=2_000_000, heldout=0.05)
    return out, out / "heldout"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="prepared token shards (default: 2M tokens of the stdlib)")
    parser.add_argument("--heldout", type=Path, help="prepared held-out shards (default: --data's heldout/ folder, "
                                                     "else the stdlib's held-out files)")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--warm-steps", type=int, default=160,
                        help="all-reduce steps from scratch that both compared runs start from (0: from scratch)")
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--outer-lr", type=float, help="parallel.diloco_outer_lr (default: the field's)")
    parser.add_argument("--outer-momentum", type=float, help="parallel.diloco_outer_momentum (default: the field's)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.data is None:
        args.data, args.heldout = stdlib_corpus()
    if args.heldout is None:
        args.heldout = args.data / "heldout"
    outer = {f"diloco_{k}": v for k, v in (("outer_lr", args.outer_lr), ("outer_momentum", args.outer_momentum))
             if v is not None}
    row = measure(args.data, args.heldout, args.steps, args.inner_steps, outer=outer, warm=args.warm_steps)
    print(f"dp={row['dp']} H={row['inner_steps']} after {row['warm_steps']} warm-up steps, {row['steps']} steps "
          f"({row['tokens']} tokens): held-out loss "
          f"{row['loss']['diloco']:.4f} vs all-reduce {row['loss']['allreduce']:.4f} "
          f"({row['loss_vs_allreduce']:+.2%}), last round's training loss {row['train_loss_vs_allreduce']:+.2%}; "
          f"dp bytes/step {row['dp_bytes_per_step']['diloco']:.0f} vs "
          f"{row['dp_bytes_per_step']['allreduce']:.0f} ({row['bytes_cut']:.1f}x fewer), syncs "
          f"{row['syncs']['diloco']} vs {row['syncs']['allreduce']}")
    if args.out:
        write_result(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "row": row}, args.data)
    if abs(row["loss_vs_allreduce"]) > TOLERANCE:
        raise SystemExit(f"DiLoCo's loss is {row['loss_vs_allreduce']:+.2%} from all-reduce's (> {TOLERANCE:.0%})")


if __name__ == "__main__":
    main()
