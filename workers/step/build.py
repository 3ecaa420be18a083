"""The job's step engine, picked once when the rank is built: a module above every engine, which each imports the
pieces of ``engine.py`` it builds on."""

from __future__ import annotations

from workers.contract.schedules import schedule as schedule_facts
from workers.step.context import StepKit
from workers.step.diloco import DiLoCoSync
from workers.step.engine import Accumulate, GradSync, PSGradSync, StepEngine
from workers.step.ps_round import PSRound


def build_engine(kit: StepKit) -> StepEngine:
    """The job's engine: replicated stages under ``parallel.stage_replicas``, PipeDream's for an asynchronous
    pipeline schedule, torch's schedules for a synchronous one, else gradient accumulation; under asp/ssp
    parameter-server rounds around it."""
    from workers.step.pipeline import (  # here: torch's pipelining imports Dynamo (~1 s)
        PipeDream,
        ReplicatedStages,
        TorchPipeline,
    )

    par = kit.spec.parallel
    syncs = {"ps": PSGradSync, "diloco": DiLoCoSync}  # else the all-reduce path's
    sync = syncs.get(par.dp_sync, GradSync)(kit)
    if par.stage_replicas is not None:
        engine = ReplicatedStages(kit)
    elif par.grid.pp_enabled and schedule_facts(par.pp_schedule).asynchronous:
        engine = PipeDream(kit)
    elif par.grid.pp_enabled:
        engine = TorchPipeline(kit, sync)
    else:
        engine = Accumulate(kit, sync)
    return PSRound(kit, engine) if kit.ps is not None and kit.ps.asynchronous else engine
