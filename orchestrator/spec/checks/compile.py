"""What `train.compile` refuses: tried on torch 2.13 (CPU, inductor, gloo; `workers/parallel/compile.py`), it fails
at the first step, so it is refused here, before any actor starts, instead."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError

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
