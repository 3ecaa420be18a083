"""Which pipeline stages a pp rank owns and which layers each stage holds.

Pure arithmetic (no torch), shared by the workers and the planner. Where a rank
sits is the ``Grid``'s business (``workers.parallel.grid``); which stages a pp
rank owns is the schedule's placement (``workers.parallel.schedules``): loop
or V shape.
"""

from __future__ import annotations

from workers.parallel.schedules import schedule as schedule_facts


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """Global stage indices owned by ``pp_rank`` under ``schedule``'s placement."""
    return schedule_facts(schedule).stage_ids(pp_rank, pp, stages_per_rank)


def layers_of_stage(stage: int, n_stages: int, n_layers: int) -> range:
    per = n_layers // n_stages
    return range(stage * per, (stage + 1) * per)
