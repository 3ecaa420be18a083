"""ZeRO-0's gradient buckets and compression, and 1-bit Adam: where they apply (workers/parallel/grad_buckets.py).

Compression at ZeRO-1 and beyond (docs/guides/hybrid-sharding.md, "Gradient compression beyond ZeRO-0"): ZeRO-1
keeps every rank's whole gradient until the reduction, so PowerSGD and top-k (whose error feedback is kept per
bucket of whole gradients) run as at ZeRO-0, their compressed all-reduce replacing the reduce-scatter
(``DistributedOptimizer.averaged``); bf16/fp16 there would all-reduce as many bytes as the fp32 reduce-scatter
sends, where ``parallel.grad_reduce_dtype: bf16`` halves them. ZeRO-2/3's FSDP2 reduce-scatters each unit's
gradients inside backward: no rank holds a whole averaged gradient to approximate, error feedback would keep the
whole local gradient FSDP2 frees, and FSDP2 has no hook for other collectives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from orchestrator.spec.fields import changed
from workers.contract.compression_kinds import WITH_FEEDBACK

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


def check_comm(job: JobSpec) -> None:
    """ZeRO-0's bucket and compression settings, and 1-bit Adam: where they apply (workers/parallel/grad_buckets.py)."""
    p, name = job.parallel, job.optim.name
    zero0 = p.zero == 0 and p.dp_sync == "allreduce"
    where = "ZeRO-0's gradient buckets (parallel.zero: 0, dp_sync: allreduce)"
    if changed(p, "bucket_mb") and not zero0:
        raise SpecError("parallel.bucket_mb", p.bucket_mb, f"is only used by {where}; this job has zero: {p.zero}, "
                        f"dp_sync: {p.dp_sync}", "remove parallel.bucket_mb, or use zero: 0")
    if p.grad_compression != "none" and not zero0:
        _check_sharded_compression(p)
    if p.grad_compression != "none" and not p.grid.dp_enabled:
        raise SpecError("parallel.grad_compression", p.grad_compression, "has nothing to compress with "
                        "parallel.dp=1 (gradients cross only the data-parallel group)",
                        "set parallel.dp above 1, or grad_compression: none")
    for field, kind in (("powersgd_rank", "powersgd"), ("powersgd_warmup_steps", "powersgd"), ("topk_ratio", "topk")):
        if changed(p, field) and p.grad_compression != kind:
            raise SpecError(f"parallel.{field}", getattr(p, field), f"is only read by grad_compression: {kind}, "
                            f"not {p.grad_compression!r}", f"set parallel.grad_compression: {kind}, or remove {field}")
    warmup = p.powersgd_warmup_steps
    if p.grad_compression == "powersgd" and warmup >= job.train.steps:
        default = "" if changed(p, "powersgd_warmup_steps") else "(the default) "
        raise SpecError("parallel.powersgd_warmup_steps", warmup, f"{default}leaves none of train.steps "
                        f"{job.train.steps} compressed: the first {warmup} steps all-reduce plainly",
                        f"set parallel.powersgd_warmup_steps below {job.train.steps} (0 compresses from the first "
                        "step), or train longer")
    if name != "onebit_adam":
        return
    _check_onebit_adam(job)


def _check_sharded_compression(p) -> None:
    """``grad_compression`` beyond ZeRO-0 (module doc): PowerSGD and top-k at ZeRO-1 over all-reduce, alone."""
    kind, ps = p.grad_compression, p.dp_sync == "ps"
    if ps or p.zero >= 2 or kind not in WITH_FEEDBACK:
        if ps:
            why, fix = "the parameter-server shards take the gradients", "use parameter_server.compression"
        elif kind not in WITH_FEEDBACK:
            why = (f"at zero: {p.zero} the reduction already is a reduce-scatter, which in 16 bits moves half its "
                   f"bytes, where a {kind} all-reduce would move as many as the fp32 reduce-scatter")
            fix = "use parallel.grad_reduce_dtype: bf16 (the same cast, in the reduce-scatter) instead"
        else:
            why = (f"FSDP2 (zero: {p.zero}) reduce-scatters each block's gradients inside backward: no rank holds the "
                   f"whole averaged gradient {kind} approximates, and its error feedback would keep the whole local "
                   "gradient that ZeRO-2/3 frees")
            fix = "use parallel.zero: 1 (or 0), or parallel.grad_reduce_dtype: bf16 at zero 2/3"
        raise SpecError("parallel.grad_compression", kind, f"is not sound here: {why}", fix)
    refused = [  # (field, value, applies, why, fix)
        ("parallel.grad_reduce_dtype", p.grad_reduce_dtype, p.grad_reduce_dtype != "fp32",
         "the compressed all-reduce replaces the reduce-scatter it sets", "remove one of the two"),
        ("parallel.ep", p.ep, p.ep > 1, "not built yet at zero: 1 (experts slice over their own edp groups)",
         "set parallel.ep: 1, or parallel.zero: 0"),
    ]
    _refuse(refused, f"parallel.grad_compression {p.grad_compression} at zero: 1")


def _check_onebit_adam(job: JobSpec) -> None:
    """1-bit Adam replaces ZeRO-0's all-reduce with its own compressed momentum (``workers/optim/onebit_adam.py``)."""
    p = job.parallel
    zero0 = p.zero == 0 and p.dp_sync == "allreduce"
    refused = [  # (field, value, applies, why, fix)
        ("parallel.zero", p.zero, not zero0, "its compressed momentum replaces ZeRO-0's gradient all-reduce",
         "set parallel.zero: 0 with dp_sync: allreduce"),
        ("parallel.grad_compression", p.grad_compression, p.grad_compression != "none",
         "it compresses its own traffic (1 bit per parameter after warm-up)", "set grad_compression: none"),
        ("parallel.tp", p.tp, p.grid.tp_enabled, "its sign compression packs plain (not tensor-parallel) tensors",
         "set parallel.tp: 1"),
        ("optim.warmup_steps", job.optim.warmup_steps, job.optim.warmup_steps == 0,
         "its second moment is measured during warm-up, then frozen", "set optim.warmup_steps (e.g. 10% of steps)"),
    ]
    _refuse(refused, "optim.name onebit_adam")


def _refuse(refused: list[tuple], other: str) -> None:
    """The first ``(field, value, applies, why, fix)`` of ``refused`` that applies, as the error naming ``other``."""
    for field, value, applies, why, fix in refused:
        if applies:
            raise SpecError(field, value, f"cannot be combined with {other}: {why}", fix)
