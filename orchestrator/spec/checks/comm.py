"""ZeRO-0's gradient buckets and compression, and 1-bit Adam: where they apply (workers/parallel/grad_buckets.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from orchestrator.spec.fields import changed

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


def check_comm(job: JobSpec) -> None:
    """ZeRO-0's bucket and compression settings, and 1-bit Adam: where they apply (workers/parallel/grad_buckets.py)."""
    p, name = job.parallel, job.optim.name
    zero0 = p.zero == 0 and p.dp_sync == "allreduce"
    where = "ZeRO-0's gradient buckets (parallel.zero: 0, dp_sync: allreduce)"
    for field in ("bucket_mb", "grad_compression"):
        if changed(p, field) and not zero0:
            raise SpecError(f"parallel.{field}", getattr(p, field), f"is only used by {where}; this job has "
                            f"zero: {p.zero}, dp_sync: {p.dp_sync}", f"remove parallel.{field}, or use zero: 0"
                            + (" (the shards' wire has parameter_server.compression)" if p.dp_sync == "ps" else ""))
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
    for field, value, applies, why, fix in refused:
        if applies:
            raise SpecError(field, value, f"cannot be combined with optim.name onebit_adam: {why}", fix)
