"""The planner's stage replication (PipeDream's planner, synchronous form): how many stages one pipeline of
``parallel.pp`` ranks should have and how many replicas each stage gets, from the model's own numbers.

A stage's cost is its training FLOPs per token (``time_model.flops_per_token`` over its blocks and the output head;
the embedding is a lookup, no matmul). Replicating stage ``s`` ``r_s`` times deals it ``1/r_s`` of the microbatches
(round-robin), so a pipeline's rate is set by its bottleneck ``max(cost_s / r_s)``; for each stage count ``k``
(2..pp, a near-even layer split, the job's own split where it gives one) the bottleneck rule
(``workers.contract.stage_replicas.replicate_bottleneck``) places the ``pp`` ranks, and the plan with the smallest
bottleneck wins, proposed only when it beats the job's own pipeline (one rank per stage, or its stage_replicas).
Compute only: the all-reduce a replicated stage adds (its gradients' bytes once per step) and the activations'
sends are not priced, so the proposal suits a model whose stages compute far more than they hold (small weights,
many tokens per step), such as a small model whose embedding/head stage outweighs the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.planning.estimate import stage_params
from orchestrator.planning.time_model import flops_per_token
from orchestrator.spec import JobSpec
from workers.contract.stage_replicas import replicate_bottleneck
from workers.parallel.layout import layers_of_stage


@dataclass(frozen=True)
class ReplicationPlan:
    """One pipeline shape: layers per stage, replicas per stage and each stage's FLOPs per token."""

    split: tuple[int, ...]
    replicas: tuple[int, ...]
    stage_flops: tuple[float, ...]

    @property
    def bottleneck(self) -> float:
        """The slowest stage's FLOPs per token per replica: what sets the pipeline's rate."""
        return max(f / r for f, r in zip(self.stage_flops, self.replicas))

    def describe(self) -> str:
        flops = ", ".join(f"{f / 1e6:.2f}" for f in self.stage_flops)
        return (f"stage_replicas {list(self.replicas)} with pp_split {list(self.split)} (MFLOPs per token and stage "
                f"[{flops}], bottleneck {self.bottleneck / 1e6:.2f} per replica)")


def stage_flops(spec: JobSpec, split: tuple[int, ...]) -> tuple[float, ...]:
    """Training FLOPs per token of each stage of ``split``: its blocks' and head's weights (6 per weight) and its
    blocks' attention scores, not the embedding table (a lookup)."""
    m, n = spec.model, len(split)
    out = []
    for stage in range(n):
        weights = sum(stage_params(spec, stage, n, split))
        if stage == 0:
            weights -= spec.padded_vocab_size * m.d_model + (m.seq_len * m.d_model if m.positions == "learned" else 0)
        out.append(flops_per_token(weights, len(layers_of_stage(stage, n, m.n_layers, split)), m.d_model, m.seq_len))
    return tuple(out)


def near_even(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """``n_layers`` over ``n_stages`` as evenly as whole layers go, the extra ones on the first stages (the last
    holds the head)."""
    base, extra = divmod(n_layers, n_stages)
    return tuple(base + (1 if s < extra else 0) for s in range(n_stages))


def current_plan(spec: JobSpec) -> ReplicationPlan:
    """The job's own pipeline as a plan: its split, its stage_replicas (else one rank per stage)."""
    split = spec.stage_split
    replicas = tuple(spec.parallel.stage_replicas or (1,) * len(split))
    return ReplicationPlan(split, replicas, stage_flops(spec, split))


def plan_replication(spec: JobSpec) -> ReplicationPlan | None:
    """The plan whose bottleneck is smallest over 2..pp stages (the job's own split where it has one for that
    count), if it beats the job's own pipeline; None when it does not, or there is no pipeline to plan."""
    p, n_layers = spec.parallel, spec.model.n_layers
    if p.pp < 2 or p.stages_per_rank != 1 or spec.model.tie_embeddings:
        return None
    own = current_plan(spec)
    best = own
    for k in range(2, min(p.pp, n_layers) + 1):
        split = own.split if k == len(own.split) else near_even(n_layers, k)
        costs = stage_flops(spec, split)
        plan = ReplicationPlan(split, replicate_bottleneck(costs, p.pp), costs)
        if plan.bottleneck < best.bottleneck * (1 - 1e-9):
            best = plan
    return None if best is own else best


def replication_advice(spec: JobSpec) -> str | None:
    """The line `raymesh plan` prints when replicating a stage would speed the pipeline up."""
    plan = plan_replication(spec)
    if plan is None:
        return None
    own = current_plan(spec)
    return (f"{plan.describe()} would run {own.bottleneck / plan.bottleneck:.2f}x this pipeline's rate (bottleneck "
            f"{own.bottleneck / 1e6:.2f} MFLOPs per token now; compute only, PipeDream's rule): set parallel."
            f"stage_replicas: {list(plan.replicas)}, pp_split: {list(plan.split)}, pp_schedule: gpipe")
