"""The pipelined engines: torch's schedules (``TorchPipeline``), PipeDream's asynchronous pipeline (``PipeDream``)
and PipeDream's replicated stages, synchronous (``ReplicatedStages``).

Both run this rank's stages of the microbatches; PipeDream also steps each stage's optimizer between them
(``workers.parallel.async_pipeline``), so its ``GradSync`` only reads the norm of the step's last updates.
"""

from __future__ import annotations

import torch

from workers.parallel.async_pipeline import AsyncPipeline, rules_for
from workers.parallel.replicated_pipeline import ReplicatedPipeline, stage_groups
from workers.step.context import StepKit
from workers.step.engine import GradSync, StepEngine


class TorchPipeline(StepEngine):
    """A ``torch.distributed.pipelining`` schedule over this rank's stages (``workers.parallel.pipeline``)."""

    def __init__(self, kit: StepKit, sync: GradSync):
        from workers.parallel.pipeline import build_schedule  # here: torch's pipelining imports Dynamo (~1 s)

        super().__init__(kit, sync)
        parts = kit.parts
        self.schedule, self.stages = build_schedule(parts.modules, parts.stage_ids, parts.n_stages,
                                                    kit.spec.parallel.pp_schedule, self.microbatches,
                                                    self.loss.share, self.device, kit.pp_group)
        self.first, self.last = kit.holds_first_stage, kit.holds_last_stage

    def events(self) -> list[dict]:
        return [e for stage in self.stages for e in stage.events]

    def clear_events(self) -> None:
        for stage in self.stages:
            stage.events.clear()

    def forward_backward(self, inputs, targets):
        losses: list[torch.Tensor] = []
        # contiguous: the loader's token windows are views ([:, :-1] has stride seq+1), and torch 2.11's
        # PipelineStage refuses an input whose strides differ from the contiguous ones it expects
        args = (inputs.contiguous(),) if self.first else ()
        documents = self.documents()
        for stage in self.stages:
            stage.documents = documents  # each chunk's, put on its cores by TimedStage._timed
        with self.autocast(), self.activations.hooks():
            self.schedule.step(*args, target=targets if self.last else None, losses=losses)
        if not self.last:
            return None
        return torch.stack([loss.detach().float() for loss in losses]).sum()  # shares of the mean


class PipeDreamSync(GradSync):
    """PipeDream averaged, clipped and stepped each update itself; the step's norm is that of each stage's last
    update, over all stages."""

    steps_optimizer = False
    stepped_within = True

    def __init__(self, kit: StepKit, pipe: AsyncPipeline):
        super().__init__(kit)
        self.pipe = pipe

    def reduce(self, loss):
        for reducer in self.reducers:
            reducer.finish()
        return loss, self.pipe.grad_norm(), True


class OwnExecutor(StepEngine):
    """An engine around one of our own pipeline executors (``self.pipe``), which records its F/B events itself."""

    pipe: AsyncPipeline | ReplicatedPipeline

    def events(self) -> list[dict]:
        return list(self.pipe.events)

    def clear_events(self) -> None:
        self.pipe.events.clear()


class PipeDream(OwnExecutor):
    """PipeDream's executor for this rank's one stage; its stashed versions travel with the ``TrainState`` into
    checkpoints and snapshots."""

    def __init__(self, kit: StepKit):
        super().__init__(kit, GradSync(kit))
        par, parts = kit.spec.parallel, kit.parts
        rules = rules_for(par.pp_schedule, par.pp_2bw_every or self.microbatches, par.pp_vertical_sync)
        self.pipe = AsyncPipeline(parts.modules[0], parts.stage_ids[0], parts.n_stages, self.microbatches, rules,
                                  kit.state.optimizers[0], self.loss, kit.pp_group, kit.dp_group,
                                  kit.spec.optim.grad_clip, self.device)
        kit.state.weight_versions = self.pipe
        self.sync = PipeDreamSync(kit, self.pipe)
        self.last_step, self.flush_per_step = kit.spec.train.steps, par.pp_flush_per_step

    def forward_backward(self, inputs, targets):
        with self.autocast(), self.activations.hooks():
            return self.pipe.run(inputs, targets, self.state.step, drain=self._drains())

    def _drains(self) -> bool:
        """Whether this step ends with no microbatch in flight: the job's last step, or every step with
        ``pp_flush_per_step`` (the asynchronous pipeline otherwise carries its steady state into the next step)."""
        return self.flush_per_step or self.state.step + 1 >= self.last_step


class StageReplicaSync(GradSync):
    """Sum each stage's gradients (and the last stage's loss) over its replicas, then the all-reduce path's clip
    on the norm that counts each stage once, and the optimizers' step."""

    def __init__(self, kit: StepKit, pipe: ReplicatedPipeline):
        super().__init__(kit)
        self.pipe = pipe

    def reduce(self, loss):
        return super().reduce(self.pipe.reduce(self.params, loss))

    def norm(self, applied: bool) -> float:
        return self.pipe.clip(self.stepped, self.grad_clip) if applied else float("nan")


class ReplicatedStages(OwnExecutor):
    """``parallel.stage_replicas``: this rank's replica of its stage, under PipeDream's round-robin
    (``workers.parallel.replicated_pipeline``)."""

    def __init__(self, kit: StepKit):
        spec, grid = kit.spec, kit.spec.parallel.grid
        replicas = spec.parallel.replicated_stages
        groups = stage_groups(grid, replicas, spec.fault_tolerance.collective_timeout_s)
        super().__init__(kit, GradSync(kit))
        stage = kit.parts.stage_ids[0]
        self.pipe = ReplicatedPipeline(kit.parts.modules[0], replicas, kit.mesh["pp"].get_local_rank(),
                                       self.microbatches, self.loss.share, kit.pp_group, groups[stage], grid.dp,
                                       self.device)
        self.sync = StageReplicaSync(kit, self.pipe)

    def forward_backward(self, inputs, targets):
        with self.autocast(), self.activations.hooks():
            return self.pipe.run(inputs, targets, self.documents())
