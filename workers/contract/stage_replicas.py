"""PipeDream's stage replication as arithmetic (torch-free): which stage and replica a pp rank is, which replica runs
a microbatch, and the planner's rule for how many replicas each stage gets.

``parallel.stage_replicas: [r0, r1, ...]`` gives one degree per pipeline stage; ``parallel.pp`` is then the number of
ranks in one pipeline (``sum(r)``), not the number of stages. Stage ``s`` occupies the consecutive pp positions
``[r0 + ... + r(s-1), ... + r(s))``; its replicas hold the same weights. Microbatch ``m`` of stage ``s`` runs on its
replica ``m mod r_s`` (PipeDream's deterministic round-robin: the forward and the backward of a microbatch on one
replica), so consecutive stages of unequal degree hand each microbatch from replica ``m mod r_s`` to replica
``m mod r_(s+1)``. Shared by the spec checks, the planner and the workers (``workers.parallel.replicated_pipeline``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageReplicas:
    """The degree of each pipeline stage, and where its replicas sit among one pipeline's pp positions."""

    degrees: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.degrees or any(not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in self.degrees):
            raise ValueError(f"stage_replicas={list(self.degrees)!r}: give one whole degree >= 1 per pipeline stage")

    @property
    def n_stages(self) -> int:
        return len(self.degrees)

    @property
    def positions(self) -> int:
        """Ranks in one pipeline: what ``parallel.pp`` must be."""
        return sum(self.degrees)

    def first_position(self, stage: int) -> int:
        """The pp position of ``stage``'s replica 0."""
        return sum(self.degrees[:stage])

    def stage_of(self, pp_rank: int) -> tuple[int, int]:
        """``(stage, replica)`` of pp position ``pp_rank``."""
        if not 0 <= pp_rank < self.positions:
            raise ValueError(f"pp rank {pp_rank} is not in a pipeline of {self.positions} ranks ({list(self.degrees)})")
        stage = 0
        while pp_rank >= self.first_position(stage + 1):
            stage += 1
        return stage, pp_rank - self.first_position(stage)

    def replica_for(self, stage: int, microbatch: int) -> int:
        """The replica of ``stage`` that runs ``microbatch`` forward and backward: round-robin."""
        return microbatch % self.degrees[stage]

    def position_for(self, stage: int, microbatch: int) -> int:
        """The pp position that runs ``microbatch`` on ``stage``."""
        return self.first_position(stage) + self.replica_for(stage, microbatch)

    def microbatches_of(self, stage: int, replica: int, microbatches: int) -> list[int]:
        """The microbatches ``replica`` of ``stage`` runs, in order."""
        return list(range(replica, microbatches, self.degrees[stage]))


def replicate_bottleneck(stage_costs: Sequence[float], ranks: int) -> tuple[int, ...]:
    """PipeDream's planner rule for a given split: with ``ranks`` ranks per pipeline and one cost per stage (its
    compute time per microbatch), hand each rank beyond one per stage to the stage whose time per replica,
    cost / replicas, is then the largest (the bottleneck), until every rank is placed. Replicating a stage r times
    divides its share of the microbatches by r, so the pipeline's rate is set by max(cost_s / r_s), which this
    greedy choice minimises (each step lowers the current maximum; ties go to the earlier stage)."""
    if ranks < len(stage_costs):
        raise ValueError(f"{ranks} ranks cannot hold {len(stage_costs)} stages: give at least one rank per stage")
    degrees = [1] * len(stage_costs)
    for _ in range(ranks - len(stage_costs)):
        slowest = max(range(len(degrees)), key=lambda s: (stage_costs[s] / degrees[s], -s))
        degrees[slowest] += 1
    return tuple(degrees)
