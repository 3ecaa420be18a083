"""What PipeDream's stage replication (`parallel.stage_replicas`) needs and refuses, before any actor starts.

The replicated pipeline (``workers.parallel.replicated_pipeline``) runs one whole stage per rank on plain
parameters, in GPipe's order, and all-reduces each stage's gradients over the ranks that hold it; what it cannot do
that way (sharded or distributed parameters, other schedules, per-rank loss scaling, experts, the pipelined
evaluation sweep) is refused here, each refusal naming the field, the value and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec

FIX = "or remove parallel.stage_replicas (one rank per stage)"


def check_stage_replicas(job: JobSpec) -> None:
    p = job.parallel
    if p.stage_replicas is None:
        return
    if p.pp != sum(p.stage_replicas):
        raise SpecError("parallel.pp", p.pp, f"is not the sum of parallel.stage_replicas {p.stage_replicas} "
                        f"({sum(p.stage_replicas)}): with stage replication pp counts the ranks of one pipeline, "
                        "every replica of every stage", f"set parallel.pp: {sum(p.stage_replicas)}, or change "
                        "stage_replicas to degrees summing to pp")
    for field, value, bad, why, change in _unsupported(job):
        if bad:
            raise SpecError(field, value, f"is not supported with parallel.stage_replicas ({why})", f"{change}, {FIX}")
    most = max(p.stage_replicas)
    if job.train.microbatches < most:
        raise SpecError("train.microbatches", job.train.microbatches, f"is below the largest stage degree {most} in "
                        f"parallel.stage_replicas {p.stage_replicas}: a replica would get no microbatch, its "
                        "round-robin share being empty", f"use {most} or more microbatches (a multiple of "
                        f"{most} balances the replicas)")


def _unsupported(job: JobSpec) -> list[tuple[str, object, bool, str, str]]:
    p, m = job.parallel, job.model
    return [
        ("parallel.pp_schedule", p.pp_schedule, p.pp_schedule != "gpipe", "the replicated pipeline runs GPipe's "
         "order (every forward, then every backward), synchronously; torch's schedules assume one rank per stage",
         "set pp_schedule: gpipe"),
        ("parallel.pp_split", "auto", p.pp_split == "auto", "the profiled split assumes one rank per stage; "
         "`raymesh plan` proposes stage_replicas for a given split instead", "give one layer count per stage, or even"),
        ("parallel.zero", p.zero, p.zero != 0, "a stage's replicas all-reduce whole, unsharded gradients",
         "set zero: 0"),
        ("parallel.tp", p.tp, p.tp > 1, "stages are whole modules, not tensor-parallel shards", "set tp: 1"),
        ("parallel.cp", p.cp, p.cp > 1, "a stage's gradients are reduced over its replicas and dp only",
         "set cp: 1"),
        ("parallel.ep", p.ep, p.ep > 1, "experts are not sharded under it", "set ep: 1"),
        ("parallel.dp_sync", p.dp_sync, p.dp_sync != "allreduce", "each stage all-reduces its gradients itself",
         "set dp_sync: allreduce"),
        ("parallel.grad_compression", p.grad_compression, p.grad_compression != "none",
         "a stage's gradients are all-reduced uncompressed", "set grad_compression: none"),
        ("memory.offload.params", True, job.memory.offload.params, "stage weights stay on the device",
         "set memory.offload.params: false"),
        ("precision.dtype", "fp16", job.precision.dtype == "fp16", "loss scaling's overflow vote spans one rank per "
         "stage", "use bf16 or fp32"),
        ("optim.name", job.optim.name, job.optim.name == "onebit_adam", "its momentum exchange runs over dp, not a "
         "stage's replicas", "use adamw"),
        ("model.moe", "set", getattr(m, "moe", None) is not None, "experts are not run under it yet",
         "remove model.moe"),
        ("eval.path", job.eval.path, job.eval.path is not None, "the held-out sweep walks one rank per stage",
         "remove eval (score the checkpoint afterwards)"),
    ]
