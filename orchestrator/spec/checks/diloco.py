"""What `parallel.dp_sync: diloco` combines with (workers/step/diloco.py), and its settings without it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from orchestrator.spec.fields import changed

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec

_SETTINGS = ("diloco_inner_steps", "diloco_outer_lr", "diloco_outer_momentum")


def check_diloco(job: JobSpec) -> None:
    """DiLoCo's replicas each keep whole weights and a whole optimizer of their own and meet every
    ``diloco_inner_steps``: anything that shares state or gradients across dp, or splits a replica in ways the
    outer step does not handle, is refused here, before any rank starts."""
    p = job.parallel
    if p.dp_sync != "diloco":
        for field in _SETTINGS:
            if changed(p, field):
                raise SpecError(f"parallel.{field}", getattr(p, field), f"is only read by parallel.dp_sync: "
                                f"diloco, and this job has dp_sync: {p.dp_sync}",
                                f"set parallel.dp_sync: diloco, or remove parallel.{field}")
        return
    g = p.grid
    refused = [  # (field, value, bad, why, fix)
        ("parallel.dp", p.dp, p.dp < 2, "DiLoCo averages the pseudo-gradients of several data-parallel "
         "replicas; with one there is nothing to average", "set parallel.dp to 2 or more"),
        ("parallel.zero", p.zero, p.zero > 0, "ZeRO shards the optimizer state (and gradients, weights) over the "
         "dp ranks, but each DiLoCo replica steps its own whole inner optimizer on weights that differ between "
         "replicas until the next outer step", "set parallel.zero: 0"),
        ("parallel.dp_shard", p.dp_shard, p.dp_shard is not None, "it shards state within data parallelism, "
         "which a DiLoCo replica keeps whole", "remove parallel.dp_shard"),
        ("parallel.tp", p.tp, g.tp_enabled, "the outer step averages plain (not tensor-parallel) weights",
         "set parallel.tp: 1 (pp composes with diloco)"),
        ("parallel.cp", p.cp, g.cp_enabled, "context parallelism averages gradients over dp x cp, which a "
         "DiLoCo replica does not", "set parallel.cp: 1"),
        ("parallel.ep", p.ep, g.ep > 1, "expert parallelism shards experts across the data-parallel ranks",
         "set parallel.ep: 1"),
        ("parallel.pp_schedule", p.pp_schedule, g.pp_enabled and p.pipeline_schedule.asynchronous,
         "an asynchronous pipeline averages each update's gradient over dp itself", "use a synchronous "
         "pp_schedule (gpipe, 1f1b, interleaved_1f1b, ...) with diloco"),
        ("parallel.grad_compression", p.grad_compression, p.grad_compression != "none", "no gradient crosses "
         "the dp group under diloco (only the weights, every diloco_inner_steps)", "remove "
         "parallel.grad_compression"),
        ("parallel.bucket_mb", p.bucket_mb, changed(p, "bucket_mb"), "no gradient bucket is all-reduced under "
         "diloco", "remove parallel.bucket_mb"),
        ("optim.name", job.optim.name, job.optim.name == "onebit_adam", "1-bit Adam averages its momentum over "
         "dp every step, which is what DiLoCo leaves out", "use optim.name: adamw (the paper's inner optimizer)"),
    ]
    for field, value, bad, why, fix in refused:
        if bad:
            raise SpecError(field, value, f"does not combine with parallel.dp_sync: diloco ({why})", fix)
