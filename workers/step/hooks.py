"""The per-step features as ``StepHook``s, each built only where the job asks for it, each filling its own entry
of the result's ``extras`` (its reducer is in ``workers.contract.figures``).

``HOOKS`` lists the factories in the order the hooks run: the memory probe reads the step's memory before the
others' ``after_update`` allocate anything, and the comm-byte count is in ``extras`` before the parameter
server's traffic joins it. A new per-step figure is a hook and a figure, registered with ``register_hook`` and
``workers.contract.figures.register``; nothing else changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from workers.data import MixedDataset
from workers.diagnostics.comm_bytes import CommBytes, mesh_dim_groups
from workers.diagnostics.memory_probe import ActivationMeter, live_state_bytes, model_state_bytes
from workers.evaluation import EvalData, Evaluator, PipelineSweep
from workers.model import moe, mtp
from workers.model.names import unwrap
from workers.parallel.layout import stage_owners
from workers.parallel.process_group import data_parallel_mesh, shard_dim
from workers.parallel.recompute import checkpointed_modules
from workers.step.context import Hooks, StepHook, StepKit


class BatchRamp(StepHook):
    """``train.batch_ramp``: sets the step's global batch before the cursor reads it; the cursor's position counts
    sequences, so the stream has no gap or repeat, and a resumed run (its step restored) picks its step's batch."""

    def __init__(self, kit: StepKit):
        self.cursor, self.train = kit.state.cursor, kit.spec.train

    def before_step(self, ctx):
        self.cursor.global_batch = self.train.batch_ramp.batch_at(ctx.step + 1, self.train.global_batch_size)
        ctx.extras["global_batch"] = self.cursor.global_batch


class MemoryProbe(StepHook):
    """``memory.measure``: the activation peak of forward and backward (an ``ActivationMeter``) and model-state
    bytes measured once the optimizers stepped, while parameters, gradients and optimizer state all exist."""

    def __init__(self, kit: StepKit):
        self.modules, self.state, self.spec = kit.parts.modules, kit.state, kit.spec
        self.slices = kit.parts.slices  # Pa: the kept input slices are counted as it keeps them
        self.meter: ActivationMeter | None = None
        self.memory: dict | None = None

    def scope(self, ctx, region):
        if region != "compute":
            return contextlib.nullcontext()
        memory, fam = self.spec.memory, self.spec.model_family
        slices = self.slices
        watched = [] if slices is not None else [
            m for part in self.modules for m in checkpointed_modules(unwrap(part), memory.recompute, fam,
                                                                     memory.recompute_every)]
        self.meter = ActivationMeter(self.modules, watched, lambda: live_state_bytes(self.modules,
                                                                                    self.state.optimizers), slices)
        return self.meter

    def after_update(self, ctx):
        self.memory = {**model_state_bytes(self.modules, self.state.optimizers), "activations": self.meter.peak,
                       "step_peak": self.meter.step_peak}
        if self.slices is not None:  # Pa+cpu's slices in host memory (0 with them on the device); the buffers
            # allocated for slices so far (memory.contiguous_checkpoints: one after the first microbatch)
            self.memory.update(activations_host=self.meter.host_peak, slice_allocations=self.slices.allocations)

    def after_step(self, ctx):
        ctx.extras["memory"], self.memory = self.memory, None


class MoEStatistics(StepHook):
    """MoE layers: where this rank's sequences start in the data stream (their routing noise is drawn per sequence
    from it) and the main loss's gradient scale before the step; each layer's load, drops and auxiliary losses,
    summed over dp, after it (the balancing biases move there too)."""

    def __init__(self, kit: StepKit):
        self.modules, self.state = kit.parts.modules, kit.state
        data = data_parallel_mesh(kit.mesh, kit.spec.parallel.grid)  # dp x cp: the ranks holding other tokens
        self.dp_group = data.get_group() if data.size() > 1 else None
        self.seed, self.microbatches = kit.spec.train.seed, kit.microbatches
        self.figures: dict | None = None

    def before_step(self, ctx):
        """The auxiliary losses' scale: the loss scale over the microbatches, as the main loss's share divides
        each microbatch's loss, pipelined or not. Under a loss mask too: the auxiliary losses are means over a
        microbatch's sequences, not sums over its counted targets, so ``counted_scale`` does not apply to them
        (``tests/integration/test_sft_parity.py``)."""
        scale = self.state.scaler.scale if self.state.scaler else 1.0
        moe.begin_step(self.modules, self.seed, self.state.cursor.start, scale / self.microbatches)

    def after_update(self, ctx):
        self.figures = moe.end_step(self.modules, self.dp_group) or None

    def after_step(self, ctx):
        ctx.extras["moe"], self.figures = self.figures, None


class MTPStatistics(StepHook):
    """``model.mtp_layers``: each depth's loss over the step's global batch and L_MTP, reported beside the
    next-token loss (which the MTP loss trains with but does not change: ``workers.model.mtp``)."""

    def __init__(self, kit: StepKit):
        self.modules, self.device = kit.parts.modules, kit.device
        data = data_parallel_mesh(kit.mesh, kit.spec.parallel.grid)
        self.dp_group = data.get_group() if data.size() > 1 else None
        self.figures: dict | None = None

    def before_step(self, ctx):
        mtp.begin_step(self.modules)

    def after_update(self, ctx):
        self.figures = mtp.end_step(self.modules, self.dp_group, self.device)

    def after_step(self, ctx):
        ctx.extras["mtp"], self.figures = self.figures, None


class Timeline(StepHook):
    """``metrics.timeline``: the step's events (pipeline F/B/W, or each microbatch's forward+backward as ``FB``,
    and each gradient bucket's reduction as ``allreduce``), stamped with the step and this rank."""

    def __init__(self, kit: StepKit):
        self.rank, self.pp_rank = kit.rank, kit.spec.parallel.grid.coords(kit.rank).pp

    def after_step(self, ctx):
        events = ctx.events + ctx.comm_events
        if events:  # an asynchronous round has none of its own
            ctx.extras["timeline"] = [{"step": ctx.step, "rank": self.rank, "pp_rank": self.pp_rank, "stage": 0, **e}
                                      for e in events]


class CommCounting(StepHook):
    """``metrics.comm_bytes``: the bytes this rank's collectives sent in the step's counted region, per mesh
    dimension (``workers.diagnostics.comm_bytes``)."""

    def __init__(self, kit: StepKit):
        grid = kit.spec.parallel.grid
        dims = mesh_dim_groups(kit.mesh, data_parallel_mesh(kit.mesh, grid))
        if grid.hybrid and grid.cp_enabled:  # a shard group spans dp_shard x cp: its bytes are the dp_shard row's
            dims[kit.mesh[shard_dim(grid)].get_group().group_name] = "dp_shard"
        self.comm = CommBytes(dims, grid.mesh_dims)

    def scope(self, ctx, region):
        return self.comm if region == "counted" else contextlib.nullcontext()

    def after_step(self, ctx):
        ctx.extras["comm_bytes"] = self.comm.take()


class PSTraffic(StepHook):
    """``dp_sync: ps``: the payload of this rank's pushes and pulls (messages, not collectives) and the staleness
    of its reads; with ``metrics.comm_bytes`` their bytes join the count under ``ps``."""

    def __init__(self, kit: StepKit):
        self.client = kit.ps.client

    def after_step(self, ctx):
        traffic = self.client.take_traffic()
        ctx.extras["ps"] = traffic
        if "comm_bytes" in ctx.extras:
            ctx.extras["comm_bytes"] = {**ctx.extras["comm_bytes"], "ps": traffic["push"] + traffic["pull"]}


class Evaluation(StepHook):
    """``eval.every``: the held-out loss of this rank's share (None off the last stage) and its seconds, after
    each step the section names (after the update: the figure is the model's at this step)."""

    def __init__(self, kit: StepKit):
        ev, par, train, model = kit.spec.eval, kit.spec.parallel, kit.spec.train, kit.spec.model
        coords = par.grid.coords(kit.rank)
        data = EvalData(ev.path, model.seq_len, kit.spec.data.seed, ev.batches, train.global_batch_size,
                        coords.dp, par.dp, coords.cp, par.grid.cp, model.attention_mask)
        sweep = None
        if par.grid.pp_enabled:
            sweep = PipelineSweep(dict(zip(kit.parts.stage_ids, kit.parts.modules)),
                                  stage_owners(par.pp, par.stages_per_rank, par.pp_schedule), kit.pp_group, kit.device)
        self.evaluator = Evaluator(kit.parts.modules, data, kit.microbatches, kit.device, kit.autocast, sweep,
                                   kit.head_part)
        self.due, self.last = ev.due, train.steps

    def after_step(self, ctx):
        if self.due(ctx.step, self.last):
            ctx.extras["eval_loss"], ctx.extras["eval_s"] = self.evaluator.run()


class DataMix(StepHook):
    """``data.mix``: the samples each source has supplied so far (the whole job's, from the stream position, so
    every rank reports the same): the run's records show the mix is the one asked for."""

    def after_step(self, ctx):
        cursor = ctx.state.cursor
        ctx.extras["data_mix"] = cursor.dataset.contributed(cursor.position)


HookFactory = Callable[[StepKit], "StepHook | None"]

HOOKS: dict[str, HookFactory] = {
    "batch_ramp": lambda kit: BatchRamp(kit) if kit.spec.train.batch_ramp else None,  # first: others read the cursor
    "memory": lambda kit: MemoryProbe(kit) if kit.spec.memory.measure else None,
    "moe": lambda kit: MoEStatistics(kit) if moe.moe_layers(kit.parts.modules) else None,
    "mtp": lambda kit: MTPStatistics(kit) if mtp.mtp_parts(kit.parts.modules) else None,
    "timeline": lambda kit: Timeline(kit) if kit.spec.metrics.timeline else None,
    "comm_bytes": lambda kit: CommCounting(kit) if kit.spec.metrics.comm_bytes else None,
    "ps": lambda kit: PSTraffic(kit) if kit.ps is not None else None,
    "eval": lambda kit: Evaluation(kit) if kit.spec.eval.every else None,
    "data_mix": lambda kit: DataMix() if isinstance(kit.state.cursor.dataset, MixedDataset) else None,
}


def register_hook(name: str, factory: HookFactory, replace: bool = False) -> None:
    """Build ``factory(kit)`` (a hook, or None where the job does not ask for it) for every rank from now on,
    after the hooks registered before it."""
    if name in HOOKS and not replace:
        raise ValueError(f"step hook {name!r} is registered already; pick another name, or pass replace=True")
    HOOKS[name] = factory


def unregister_hook(name: str) -> None:
    HOOKS.pop(name, None)


def build_hooks(kit: StepKit, last: StepHook) -> Hooks:
    """The job's hooks in ``HOOKS`` order, then ``last`` (the objective: its figures after the features')."""
    built = [factory(kit) for factory in HOOKS.values()]
    return Hooks([hook for hook in built if hook is not None] + [last])
