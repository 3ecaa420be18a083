"""The throughput settings: `train.compile`, `optim.implementation` and `parallel.fsdp_prefetch`, and the
combinations they refuse.

What `train.compile` refuses was tried on torch 2.13 (CPU, inductor, gloo; `workers/parallel/compile.py`) and
fails at the first step; it is refused here, before any actor starts, instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from workers.optim.implementations import offered

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec

_OFF = "or set train.compile: false"


def check_compile(job: JobSpec) -> None:
    """Combinations whose blocks Dynamo cannot trace whole (each block is compiled with ``fullgraph``)."""
    if not job.train.compile:
        return
    p, m = job.parallel, job.memory
    refused = [  # (applies, field, value, problem, fix)
        (p.grid.pp_enabled and p.pipeline_schedule.split_backward, "parallel.pp_schedule", p.pp_schedule,
         "cannot combine with train.compile: it splits each stage's backward into an input-gradient and a "
         "deferred weight-gradient pass, and a compiled block's backward computes both at once (the input pass "
         "fails at the first step)", f"use pp_schedule 1f1b, gpipe or interleaved_1f1b, {_OFF}"),
        (p.cp > 1, "parallel.cp", p.cp, "cannot combine with train.compile: the context-parallel attention "
         "exchanges K/V with point-to-point sends inside the block, which Dynamo cannot trace",
         f"use parallel.cp: 1, {_OFF}"),
        (job.model.moe is not None, "model.moe", "set", "cannot combine with train.compile: the MoE layer's "
         "routing (data-dependent token counts, autograd state read in forward) does not trace as one graph",
         f"remove model.moe, {_OFF}"),
        (p.tp > 1 and m.recompute != "none", "memory.recompute", m.recompute, "cannot combine with parallel.tp "
         "> 1 under train.compile on torch 2.13: AOTAutograd's activation-checkpoint region over DTensors saves a "
         "DeviceMesh for backward and fails at the first step", f"set memory.recompute: none, or parallel.tp: 1, "
         f"{_OFF}"),
        (m.measure and m.recompute != "none", "memory.measure", True, f"with memory.recompute {m.recompute!r} "
         "cannot combine with train.compile: the meter watches the recomputed modules from forward hooks that "
         "would run inside the compiled block", f"set memory.measure: false or memory.recompute: none, {_OFF}"),
    ]
    for applies, field, value, problem, fix in refused:
        if applies:
            raise SpecError(field, value, problem, fix)


def check_optim_implementation(job: JobSpec) -> None:
    """A forced implementation must be one the optimizer's PyTorch class takes, on a path that steps it."""
    o, p = job.optim, job.parallel
    if o.implementation == "auto":
        return
    offloaded = job.memory.offload.optimizer and o.name in ("adam", "adamw")
    choices = offered(o.name, offloaded)
    if p.dp_sync == "ps":
        raise SpecError("optim.implementation", o.implementation, "is not used under parallel.dp_sync: ps: the "
                        "parameter-server shards step the optimizer", "remove optim.implementation (auto)")
    if o.implementation in ("fused", "foreach") and p.tp > 1 and (not p.sequence_parallel or job.model.moe):
        why = "the plain norms beside" if not p.sequence_parallel else "the replicated MoE experts beside"
        raise SpecError("optim.implementation", o.implementation, f"cannot step {why} the TP-sharded DTensors: "
                        "PyTorch's multi-tensor kernels refuse a list mixing DTensors and plain tensors",
                        "use for_loop or auto" + ("" if p.sequence_parallel else
                                                  ", or parallel.sequence_parallel: true"))
    if o.implementation not in choices:
        whose = "the offloaded Adam (memory.offload.optimizer)" if offloaded else f"optim.name {o.name!r}"
        fix = (f"use one of {', '.join(choices)} or auto" if choices else
               "remove optim.implementation (auto), or use optim.name adamw, adam or sgd"
               + (" without memory.offload.optimizer" if offloaded else ""))
        raise SpecError("optim.implementation", o.implementation, f"is not offered by {whose}", fix)


def check_fsdp_prefetch(job: JobSpec) -> None:
    """Explicit prefetch is set on FSDP2's units, which exist only under ZeRO-2/3 (which `dp_sync: ps` refuses)."""
    p = job.parallel
    if p.fsdp_prefetch and p.zero < 2:
        raise SpecError("parallel.fsdp_prefetch", p.fsdp_prefetch, f"needs FSDP2's units, and parallel.zero={p.zero} "
                        "has none to gather ahead", "set parallel.zero: 2 or 3, or remove parallel.fsdp_prefetch")
