"""Which pipeline stages a pp rank owns and which layers each stage holds.

Pure arithmetic (no torch), shared by the workers and the planner. Where a rank
sits is the ``Grid``'s business (``workers.contract.grid``); which stages a pp
rank owns is the schedule's placement (``workers.contract.schedules``): loop
or V shape. How many layers each stage holds is ``parallel.pp_split``, resolved before the workers start
(``workers.parallel.partition``).
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.contract.schedules import schedule as schedule_facts
from workers.parallel.partition import even_split, stage_bounds


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """Global stage indices owned by ``pp_rank`` under ``schedule``'s placement."""
    return schedule_facts(schedule).stage_ids(pp_rank, pp, stages_per_rank)


def stage_owners(pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The pp rank owning each global stage, in stage order (``stage_ids`` the other way round)."""
    owner = {s: r for r in range(pp) for s in stage_ids(r, pp, stages_per_rank, schedule)}
    return [owner[s] for s in range(pp * stages_per_rank)]


def layers_of_stage(stage: int, n_stages: int, n_layers: int, split: Sequence[int] | None = None) -> range:
    """Global layer indices of ``stage``: ``split``'s share (layer counts per stage), else an even one."""
    if split is None or len(split) != n_stages:  # e.g. the planner's whole-model-as-one-stage FLOPs count
        split = even_split(n_layers, n_stages)
    return stage_bounds(split)[stage]


def own_stages(par, pp_rank: int) -> tuple[int, list[int]]:
    """The pipeline's stage count and the global ids of the stages pp rank ``pp_rank`` holds (``par``: a job's
    ``parallel`` section): its one stage under ``stage_replicas`` (a replica of it), else the schedule's placement."""
    replicas = par.replicated_stages
    if replicas is not None:
        return replicas.n_stages, [replicas.stage_of(pp_rank)[0]]
    return par.n_stages, stage_ids(pp_rank, par.pp, par.stages_per_rank, par.pp_schedule)
