"""Where a rank sits in the grid and which pipeline stages and layers it owns.

Pure arithmetic (no torch), shared by the workers and the planner. The grid is
``dp × pp × tp`` with tensor parallelism innermost, so consecutive ranks form a
TP group (the ones a placement group packs onto one node). Loop-style
schedules place stage ``r + v*pp`` on pp rank ``r``; the V-shaped ones (ZBV,
DualPipeV) place stages ``r`` and ``2*pp-1-r`` so the first and last stage
share a rank.
"""

from __future__ import annotations

from dataclasses import dataclass

V_SHAPED = frozenset({"zbv", "dualpipev"})


@dataclass(frozen=True)
class Coordinates:
    dp: int
    pp: int
    tp: int


def coordinates(rank: int, dp: int, pp: int, tp: int) -> Coordinates:
    return Coordinates(dp=rank // (pp * tp), pp=(rank // tp) % pp, tp=rank % tp)


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """Global stage indices owned by ``pp_rank``."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(stages_per_rank)]


def layers_of_stage(stage: int, n_stages: int, n_layers: int) -> range:
    per = n_layers // n_stages
    return range(stage * per, (stage + 1) * per)
