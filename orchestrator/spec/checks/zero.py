"""ZeRO and FSDP2's units: stage 3 with split-backward schedules, and explicit all-gather prefetch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


def check_zero(job: JobSpec) -> None:
    """Combinations PyTorch 2.13's own pieces get wrong; refused rather than trained silently wrong."""
    p = job.parallel
    refused = [  # (applies, zero, problem, fix)
        (p.zero == 3 and p.grid.pp_enabled and p.pipeline_schedule.split_backward, 3,
         f"with pp_schedule {p.pp_schedule!r} gives wrong gradients: its deferred weight-gradient pass "
         "runs after FSDP2 has resharded the parameters (PyTorch issue 164756)",
         "use zero: 2 with this schedule, or pp_schedule: interleaved_1f1b with zero: 3"),
    ]
    for applies, zero, problem, fix in refused:
        if applies:
            raise SpecError("parallel.zero", zero, problem, fix)


def check_fsdp_prefetch(job: JobSpec) -> None:
    """Explicit prefetch is set on FSDP2's units, which exist only under ZeRO-2/3 (which `dp_sync: ps` refuses)."""
    p = job.parallel
    if p.fsdp_prefetch and p.zero < 2:
        raise SpecError("parallel.fsdp_prefetch", p.fsdp_prefetch, f"needs FSDP2's units, and parallel.zero={p.zero} "
                        "has none to gather ahead", "set parallel.zero: 2 or 3, or remove parallel.fsdp_prefetch")


def check_fsdp_buckets(job: JobSpec) -> None:
    """Constant-size buckets are FSDP2 units of several blocks: they exist only under ZeRO-2/3, and explicit
    prefetch and parameter offload address the units block by block (a grouped unit would be fetched twice)."""
    p, bucket = job.parallel, job.parallel.fsdp_bucket_mb
    if bucket is None:
        return
    refused = [
        ("parallel.zero", p.zero, p.zero < 2, "has no FSDP2 units for parallel.fsdp_bucket_mb to group (ZeRO-0 "
         "buckets its gradients by parallel.bucket_mb)", "set parallel.zero: 2 or 3, or remove "
         "parallel.fsdp_bucket_mb"),
        ("parallel.fsdp_prefetch", p.fsdp_prefetch, p.fsdp_prefetch > 0, "prefetches block by block, and "
         "parallel.fsdp_bucket_mb puts several blocks in one unit", "remove one of parallel.fsdp_prefetch and "
         "parallel.fsdp_bucket_mb"),
        ("memory.offload.params", True, job.memory.offload.params, "fetches and evicts each block's shard by "
         "itself, and parallel.fsdp_bucket_mb puts several blocks in one unit", "remove one of "
         "memory.offload.params and parallel.fsdp_bucket_mb"),
    ]
    for field, value, applies, why, fix in refused:
        if applies:
            raise SpecError(field, value, why, fix)
