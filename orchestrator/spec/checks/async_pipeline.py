"""What PipeDream's asynchronous schedules (`pp_schedule: pipedream | pipedream_2bw`) need and refuse.

Checked before any actor starts, each refusal naming the field, the value and the fix. The executor
(`workers.parallel.async_pipeline`) runs one whole stage per rank on stashed copies of its plain parameters and
steps the optimizer itself between microbatches, averaging each update's gradient over dp; what it cannot do
that way is refused here rather than run with the wrong weights:
sharded or distributed parameters and optimizers (ZeRO, TP, CP, EP, parameter servers), recompute (it reruns a
forward outside the stashed weights), fp16 loss scaling (an update skipped on one stage only), adapters and
experts (not tested with it), compressed or optimizer-side gradient exchange.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


ASYNC = ("pipedream", "pipedream_2bw")


def check_async_pipeline(job: JobSpec) -> None:
    p = job.parallel
    _check_own_fields(job)
    if p.pp_schedule not in ASYNC:
        return
    if p.pp < 2:
        raise SpecError("parallel.pp", p.pp, f"is too small for pp_schedule {p.pp_schedule!r}, an asynchronous "
                        "pipeline of at least 2 stages", "set parallel.pp: 2 or more, or pp_schedule: 1f1b")
    fix = f"or use pp_schedule: 1f1b (PipeDream-flush) instead of {p.pp_schedule}"
    for field, value, bad, why, change in _unsupported(job):
        if bad:
            raise SpecError(field, value, f"is not supported with pp_schedule {p.pp_schedule!r} ({why})",
                            f"{change}, {fix}")
    if p.pp_schedule == "pipedream_2bw":
        _check_2bw_window(job)


def _check_own_fields(job: JobSpec) -> None:
    """`pp_vertical_sync` and `pp_2bw_every` belong to one schedule each, `pp_flush_per_step` to both."""
    p = job.parallel
    if p.pp_vertical_sync and p.pp_schedule != "pipedream":
        raise SpecError("parallel.pp_vertical_sync", True, f"applies to pp_schedule 'pipedream' only (this job "
                        f"runs {p.pp_schedule!r}; 2BW always runs a microbatch on one version everywhere)",
                        "remove pp_vertical_sync, or set pp_schedule: pipedream")
    if p.pp_2bw_every is not None and p.pp_schedule != "pipedream_2bw":
        raise SpecError("parallel.pp_2bw_every", p.pp_2bw_every, f"applies to pp_schedule 'pipedream_2bw' only "
                        f"(this job runs {p.pp_schedule!r})", "remove pp_2bw_every, or set pp_schedule: pipedream_2bw")
    if p.pp_flush_per_step and p.pp_schedule not in ASYNC:
        raise SpecError("parallel.pp_flush_per_step", True, f"applies to the asynchronous schedules {list(ASYNC)} "
                        f"only (this job runs {p.pp_schedule!r}, which drains at every step end anyway)",
                        "remove pp_flush_per_step, or set pp_schedule: pipedream or pipedream_2bw")


def _unsupported(job: JobSpec) -> list[tuple[str, object, bool, str, str]]:
    p, m = job.parallel, job.model
    return [
        ("parallel.zero", p.zero, p.zero != 0, "each update steps whole, unsharded parameters", "set zero: 0"),
        ("parallel.tp", p.tp, p.tp > 1, "stashed weight copies are plain tensors, not tensor-parallel shards",
         "set tp: 1"),
        ("parallel.cp", p.cp, p.cp > 1, "an update averages over dp only", "set cp: 1"),
        ("parallel.ep", p.ep, p.ep > 1, "experts are not sharded under it", "set ep: 1"),
        ("parallel.virtual_stages", p.virtual_stages, (p.virtual_stages or 1) != 1,
         "it runs one stage per pp rank", "remove virtual_stages"),
        ("parallel.dp_sync", p.dp_sync, p.dp_sync != "allreduce", "the executor averages each update over dp "
         "itself", "set dp_sync: allreduce"),
        ("parallel.grad_compression", p.grad_compression, p.grad_compression != "none",
         "each update's gradient is averaged uncompressed", "set grad_compression: none"),
        ("memory.recompute", job.memory.recompute, job.memory.recompute != "none",
         "a recomputed forward would run on the live weights, not the microbatch's stashed version",
         "set memory.recompute: none"),
        ("memory.offload.params", True, job.memory.offload.params, "stashed versions are copies on the device",
         "set memory.offload.params: false"),
        ("precision.dtype", "fp16", job.precision.dtype == "fp16",
         "a loss-scale overflow would skip an update on one stage only", "use bf16 or fp32"),
        ("optim.name", job.optim.name, job.optim.name == "onebit_adam",
         "its momentum exchange assumes one synchronous step", "use adamw"),
        ("model.moe", "set", getattr(m, "moe", None) is not None, "experts are not run under it yet",
         "remove model.moe"),
        ("model.lora", "set", getattr(m, "lora", None) is not None, "adapters are not run under it yet",
         "remove model.lora"),
    ]


def _check_2bw_window(job: JobSpec) -> None:
    """A version every m microbatches with m >= pp (else a microbatch would need a third version), and whole
    windows per step (a step ends on an update, so a checkpoint holds exactly the two versions)."""
    p, mb = job.parallel, job.train.microbatches
    every = p.pp_2bw_every or mb
    field, value = ("parallel.pp_2bw_every", every) if p.pp_2bw_every else ("train.microbatches", mb)
    if every < p.pp:
        raise SpecError(field, value, f"is below parallel.pp={p.pp}: PipeDream-2BW needs at least pp "
                        "microbatches per weight version, or in-flight microbatches would need a third version",
                        f"use {p.pp} or more microbatches per version")
    if mb % every:
        options = [d for d in range(p.pp, mb + 1) if mb % d == 0]
        raise SpecError("parallel.pp_2bw_every", every, f"does not divide train.microbatches={mb}: a step must "
                        "end on a new version", f"pick pp_2bw_every from {options} or remove it (default: "
                        "train.microbatches)")
