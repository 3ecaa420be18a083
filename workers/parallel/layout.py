"""Where a rank sits in the grid and which pipeline stages and layers it owns.

Pure arithmetic (no torch), shared by the workers and the planner. The grid is
``dp × pp × tp`` with tensor parallelism innermost, so consecutive ranks form a
TP group (the ones a placement group packs onto one node). Which stages a pp
rank owns is the schedule's placement (``workers.parallel.schedules``): loop
or V shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.parallel.schedules import schedule as schedule_facts


@dataclass(frozen=True)
class Coordinates:
    """A rank's dp/pp/tp indices (see ``coordinates``)."""

    dp: int
    pp: int
    tp: int


def coordinates(rank: int, dp: int, pp: int, tp: int) -> Coordinates:
    """Superseded by ``Grid.coords``; kept while workers/trainer.py and orchestrator/runtime/rank_group.py use it
    (their ``vars(coords)`` must stay dp/pp/tp only: it is the layout JSON)."""
    return Coordinates(dp=rank // (pp * tp), pp=(rank // tp) % pp, tp=rank % tp)


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """Global stage indices owned by ``pp_rank`` under ``schedule``'s placement."""
    return schedule_facts(schedule).stage_ids(pp_rank, pp, stages_per_rank)


def layers_of_stage(stage: int, n_stages: int, n_layers: int) -> range:
    per = n_layers // n_stages
    return range(stage * per, (stage + 1) * per)
