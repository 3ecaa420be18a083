"""`train.global_batch_size` and `train.microbatches` against data parallelism and the pipeline schedule."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from orchestrator.spec.fields import _divisors, _near_multiples

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


def pipeline_problem(job: JobSpec, microbatches: int) -> str | None:
    """Why a pipeline schedule cannot run `microbatches` microbatches, or None if it can."""
    pp, schedule, facts = job.parallel.pp, job.parallel.pp_schedule, job.parallel.pipeline_schedule
    if pp == 1:
        return None
    if facts.interleaved and microbatches % pp:
        return f"is not a multiple of parallel.pp={pp}, which pp_schedule {schedule!r} requires"
    if facts.min_microbatches_per_pp > 1 and microbatches < facts.min_microbatches(pp):
        # one microbatch per stage: the V-shaped dualpipev runs two stages a rank
        return (
            f"is below the {facts.min_microbatches(pp)} pipeline stages of pp_schedule {schedule!r} (two per rank); "
            f"it needs microbatches >= {facts.min_microbatches_per_pp}*pp"
        )
    if microbatches < pp:
        return (
            f"is below parallel.pp={pp}; pp_schedule {schedule!r} needs at least one microbatch "
            "per pipeline rank (microbatches >= pp)"
        )
    return None


def check_batching(job: JobSpec) -> None:
    t, dp, pp = job.train, job.parallel.dp, job.parallel.pp
    gbs, mb = t.global_batch_size, t.microbatches
    if gbs % dp:
        dps = [d for d in _divisors(gbs) if (gbs // d) % mb == 0]
        raise SpecError(
            "train.global_batch_size",
            gbs,
            f"is not divisible by parallel.dp={dp}",
            f"use a multiple of dp*microbatches = {dp * mb} (e.g. {_near_multiples(gbs, dp * mb)}), "
            f"or pick parallel.dp from {dps}",
        )
    per_rank = gbs // dp
    valid = [m for m in _divisors(per_rank) if pipeline_problem(job, m) is None]
    if valid:
        fix = f"pick train.microbatches from {valid}"
    else:
        step = dp * pp
        fix = (
            f"raise train.global_batch_size to a multiple of dp*pp = {step} "
            f"(e.g. {_near_multiples(gbs, step)[-1]}) and set train.microbatches: {pp}"
        )
    if per_rank % mb:
        raise SpecError(
            "train.microbatches",
            mb,
            f"does not divide the per-data-rank batch global_batch_size/dp = {gbs}/{dp} = {per_rank}",
            fix,
        )
    problem = pipeline_problem(job, mb)
    if problem:
        raise SpecError("train.microbatches", mb, problem, fix)


def check_batch_ramp(job: JobSpec) -> None:
    """`train.batch_ramp`'s sizes must each split into dp ranks' microbatches and end at the global batch; the
    pipeline (its microbatch shapes fixed at build) and parameter-server rounds (their position is rounds times
    one batch) take one batch size."""
    t, p = job.train, job.parallel
    ramp = t.batch_ramp
    if ramp is None:
        return
    unit, full = p.dp * t.microbatches, t.global_batch_size
    if ramp.start >= full:
        raise SpecError("train.batch_ramp.start", ramp.start, f"is not below train.global_batch_size {full}, "
                        "where the ramp ends", f"set it below {full}, or remove train.batch_ramp")
    for name, value in (("start", ramp.start), ("increment", ramp.increment)):
        if value is not None and value % unit:
            raise SpecError(f"train.batch_ramp.{name}", value, f"is not a multiple of parallel.dp * "
                            f"train.microbatches = {unit}, so its batches would not split into equal microbatches",
                            f"use a multiple of {unit} (e.g. {_near_multiples(value, unit)})")
    inc = ramp.increment or ramp.start
    if (full - ramp.start) % inc:
        raise SpecError("train.batch_ramp.increment", inc, f"does not divide train.global_batch_size - start = "
                        f"{full - ramp.start}, so the ramp would never reach {full}",
                        f"pick an increment dividing {full - ramp.start} that is a multiple of {unit}")
    for field, value, bad in (("parallel.pp", p.pp, p.pp > 1), ("parallel.dp_sync", p.dp_sync, p.dp_sync == "ps")):
        if bad:
            raise SpecError(field, value, "takes one batch size for every step, and train.batch_ramp changes it",
                            f"remove train.batch_ramp, or set {field} back to its default")
