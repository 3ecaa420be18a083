"""What the `eval:` section needs and refuses (the held-out loss, `workers/evaluation.py`).

Each refusal names the field, the value and the fix, before any actor starts. The evaluation scores the model
the ranks hold after a step, so it is refused where there is no one model to score: free-running
parameter-server replicas (asp/ssp: each rank's weights are its own) and an asynchronous pipeline that carries
microbatches from one step into the next (its stages hold different weight versions, and its messages in
flight would meet the evaluation's). Whether the directory holds enough sequences is checked with the data
(`runtime_checks.check_eval_path`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


def check_eval(job: JobSpec) -> None:
    check_keep_best(job)
    ev, p = job.eval, job.parallel
    if ev.every == 0:
        if ev.path is not None:  # refused, not ignored: the job file would promise a held-out loss
            raise SpecError("eval.every", 0, f"never evaluates, but eval.path is set ({ev.path})",
                            "set eval.every to the steps between evaluations (e.g. 50), or remove eval.path")
        return
    if ev.path is None:
        raise SpecError("eval.path", None, f"is required with eval.every={ev.every} (the held-out sequences to score)",
                        "point it at a prepared directory the model does not train on: `raymesh prepare-data "
                        "--heldout 0.01 --out DIR` writes one to DIR/heldout")
    if p.dp_sync == "ps" and job.parameter_server.consistency != "bsp":
        raise SpecError("eval.every", ev.every, f"is not supported with parameter_server.consistency "
                        f"{job.parameter_server.consistency} (free-running replicas each hold their own weights, "
                        "so there is no one model to score)", "use consistency: bsp, or remove the eval section")
    if p.pipeline_schedule.asynchronous and not p.pp_flush_per_step:
        raise SpecError("eval.every", ev.every, f"needs pp_schedule {p.pp_schedule!r} drained at each step end "
                        "(otherwise its stages hold different weight versions and microbatches in flight)",
                        "set parallel.pp_flush_per_step: true, or remove the eval section")


def check_keep_best(job: JobSpec) -> None:
    """`checkpoint.keep_best` goes by the held-out loss saved with each checkpoint, so every checkpoint step must
    be an evaluation step: evaluations on, checkpoints on, and `eval.every` dividing `checkpoint.every`."""
    ck, ev = job.checkpoint, job.eval
    if not ck.keep_best:
        return
    if ev.every == 0:
        raise SpecError("checkpoint.keep_best", True, "needs a held-out loss to rank checkpoints by, and eval.every "
                        "is 0", "set eval.every and eval.path (e.g. eval.every equal to checkpoint.every), or remove "
                        "checkpoint.keep_best")
    if ck.every == 0:
        raise SpecError("checkpoint.keep_best", True, "has no checkpoints to keep: checkpoint.every is 0",
                        f"set checkpoint.every to a multiple of eval.every ({ev.every}), or remove "
                        "checkpoint.keep_best")
    if ck.every % ev.every:
        near = ev.every * max(1, round(ck.every / ev.every))
        raise SpecError("checkpoint.every", ck.every, f"is not a multiple of eval.every={ev.every}, so with "
                        "checkpoint.keep_best some checkpoints would have no held-out loss to be ranked by",
                        f"set checkpoint.every to a multiple of {ev.every} (e.g. {near}), or eval.every to a "
                        "divisor of it")
