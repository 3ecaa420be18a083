"""One rank: what it builds (mesh, model parts, ``TrainState``) and its step, composed of parts chosen once.

The step's parts live in ``workers.step``: an engine (accumulation, a pipeline schedule, PipeDream, asp/ssp
rounds), an objective (``train.objective``) and the hooks of the per-step features; ``train_step`` runs the
engine under them and packs the result. The trainer knows nothing of Ray or the controller: it takes the plain job
spec dict (parsed once into a ``WorkerSpec`` of typed sections) and its rank, so the same code runs inside a
``RankWorker`` actor, under ``torchrun`` (the benchmark baseline) or single-process (the reference).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import zlib

import torch

from workers.contract.compression_kinds import WITH_FEEDBACK
from workers.data import DataCursor, open_data
from workers.data.loader import document_eos
from workers.diagnostics.faults import StepFault
from workers.model.names import unwrap
from workers.offload.activations import activation_policy
from workers.offload.host_memory import release_freed_buffers
from workers.offload.params import offload_params
from workers.optim.build import build_optimizer, lr_lambda
from workers.optim.loss_scaler import DynamicLossScaler
from workers.optim.onebit_adam import OneBitAdam
from workers.parallel.distributed_optimizer import sliced_optimizer
from workers.parallel.parallelize import build_parts, zero0_buckets
from workers.parallel.process_group import data_parallel_mesh, init_mesh, pick_device, shard_dim
from workers.parallel.ps_sync import PSSync
from workers.protocol import StepResult
from workers.spec import WorkerSpec
from workers.state.checkpoint_io import CheckpointIO
from workers.state.compression_feedback import CompressionFeedback
from workers.state.train_state import TrainState
from workers.step.build import build_engine
from workers.step.context import StepContext, StepKit
from workers.step.hooks import build_hooks
from workers.step.objectives import build_objective, check_objective

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Trainer:
    """One rank: its share of the model (``parts``), its ``TrainState``, and the step parts built once around them:
    the engine (how it steps), the objective (what it minimises) and the hooks (the per-step features)."""

    def __init__(self, spec: dict, rank: int, world_size: int, master_addr: str, master_port: int,
                 listener: socket.socket | None = None):
        self.spec = WorkerSpec.from_dict(spec)
        check_objective(self.spec.train.objective)
        self.rank = rank
        par, memory = self.spec.parallel, self.spec.memory
        self.grid = par.grid
        self.coords = self.grid.coords(rank)
        self.device = pick_device(par.device)
        if memory.offload.params:
            release_freed_buffers()  # before the model is built, so evicted shards' host memory goes back to the OS
        self.mesh = init_mesh(rank, world_size, master_addr, master_port, self.grid,
                              self.device, timeout_s=self.spec.fault_tolerance.collective_timeout_s, listener=listener)
        self.parts = build_parts(self.spec, self.mesh, self.device)
        # expert parallelism: the experts' gradient norm is summed over the ep (x tp) ranks that split them
        self.expert_norm = ([p for e in self.parts.experts for p in e.parameters()], self.parts.expert_norm_group) \
            if self.parts.ep_group is not None else ()
        self.param_offload = offload_params(self.parts.modules, memory.offload, self.device)
        self.state = self._train_state()
        feedback = self._error_feedback()
        if feedback:  # each rank's own, kept across recoveries and resumes
            self.state.wire_feedback = CompressionFeedback(feedback, self._feedback_layout(), rank, self.device)
        self.activations = activation_policy(memory, self.device)
        # under FSDP2's mixed-precision policy the bf16 parameters set the compute dtype; no autocast on top
        mixed = self.spec.fsdp_mixed(self.device.type == "cuda")
        self.autocast_dtype = None if mixed else AUTOCAST.get(self.spec.precision.dtype)
        self._bind(self.parts)
        # where the state stands against the last step boundary (``regroup``, ``RankWorker.restore_snapshot``):
        # a step began and did not end; an optimizer stepped since the last boundary
        self.mid_step = self.weights_moved = False
        for opt in self.state.optimizers:
            opt.register_step_pre_hook(self._on_optimizer_step)
        self._built_rng = self._rng_state()  # the global streams as a freshly built rank leaves them

    def _bind(self, parts) -> None:
        """The objects bound to the process group or to this rank's place in it: the step's parts (engine,
        objective, hooks: each captures the mesh, its groups and the rank), checkpoint I/O and the parameter server's
        client. Built once here, and again by ``regroup`` around the kept model and state."""
        par = self.spec.parallel
        self.pp_group = self.mesh["pp"].get_group() if par.grid.pp_enabled else None
        self.dp_group = self.mesh["dp"].get_group() if par.grid.dp_enabled else None
        self.checkpoints = CheckpointIO(self.state)
        self.ps = PSSync(self.spec, self.state, self.parts, self.coords, self.mesh, self.device) \
            if par.dp_sync == "ps" else None
        kit = StepKit(self.spec, self.rank, self.device, self.mesh, parts, self.state,
                      [p for m in self.parts.modules for p in m.parameters()], self.zero1, self.expert_norm,
                      self.dp_group, self.pp_group, self._autocast, self.activations, self.ps)
        self.objective = build_objective(kit)
        self.engine = build_engine(kit)
        self.hooks = build_hooks(kit, self.objective)

    # -- recovery: keep_training: a new process group around the kept model ---------------------------------

    def regroup(self, spec: dict, rank: int, world_size: int, master_addr: str, master_port: int,
                listener: socket.socket | None = None) -> None:
        """Join a new process group (the old one destroyed by the caller) as ``rank`` of ``world_size`` under
        ``spec``, keeping the model, optimizers, data cursor and every other piece of state.

        Why: under ``recovery: keep_training`` (plain data parallelism) a rank's model and optimizer are bound to
        no group but through the gradient averaging, so re-forming the group around a surviving replica (and again
        when the rebuilt one rejoins) needs no rebuild: the averaging buckets move to the new group, the step's
        parts are made again around it as a new rank makes them, and the global random streams go back to where
        a built rank leaves them. What a failed step left (gradients, a bucket's launched reduction, the data
        cursor moved on) is dropped here or put back by ``RankWorker.restore_snapshot``. ``ValueError`` (naming
        what differs) where ``spec`` asks for more than another group: the caller builds the rank anew."""
        new = WorkerSpec.from_dict(spec)
        why = self.regroup_refused(new, rank)
        if why:
            raise ValueError(f"rank {self.rank} cannot keep its trainer: {why}")
        self.spec, self.rank = new, rank
        self.grid, self.coords = new.parallel.grid, new.parallel.grid.coords(rank)
        self.mesh = init_mesh(rank, world_size, master_addr, master_port, self.grid, self.device,
                              timeout_s=new.fault_tolerance.collective_timeout_s, listener=listener)
        dp_mesh = data_parallel_mesh(self.mesh, self.grid)
        if not self.parts.reducers and dp_mesh.size() > 1:  # built alone (``RankWorker.prebuild``): no buckets yet
            self.parts = dataclasses.replace(self.parts, reducers=zero0_buckets(
                new, new.model_family, self.parts.modules, dp_mesh, self.parts.experts, None))
        for reducer in self.parts.reducers:
            reducer.rebind(dp_mesh.get_group())
        for opt in self.state.optimizers:  # a failed step's partial gradients would add to the next step's
            opt.zero_grad(set_to_none=True)
        if self.activations.store is not None:  # a failed backward's offloaded activations go with their store
            self.activations.store.close()
        self.activations = activation_policy(new.memory, self.device)
        # one replica left: nothing to average over, as a rank built alone has no buckets (its hooks stay silent)
        alone = dp_mesh.size() == 1
        for reducer in self.parts.reducers:
            reducer.paused = alone
        self._bind(dataclasses.replace(self.parts, reducers=[]) if alone else self.parts)
        self._set_rng_state(self._built_rng)

    def regroup_refused(self, new: WorkerSpec, rank: int) -> str:
        """Why this trainer cannot move to the group ``new`` describes (empty when it can): only plain data
        parallelism's averaging is bound to the group, and only the data-parallel degree (and the data slot each
        replica reads) may differ."""
        old, par = self.spec, new.parallel
        if dataclasses.replace(new, parallel=old.parallel, data_slot=old.data_slot) != old or \
                par.model_copy(update={"dp": old.parallel.dp}) != old.parallel:
            return "the new spec differs in more than parallel.dp and the data slot"
        if par.grid.positions != 1 or par.grid.ep_enabled or par.zero != 0 or par.dp_sync != "allreduce":
            return (f"only plain data parallelism moves (pp=tp=cp=ep=1, zero 0, dp_sync allreduce), and this rank "
                    f"has pp*cp*tp={par.grid.positions}, ep={par.grid.ep}, zero={par.zero}, dp_sync={par.dp_sync}")
        if self.state.wire_feedback is not None:
            return "it keeps error feedback of its old group's compression"
        if new.optim.name in ("muon", "onebit_adam"):  # both take the data-parallel group when built
            return f"optim.name {new.optim.name} holds the old data-parallel group"
        slot = new.data_slot or (par.grid.coords(rank).dp, par.dp)
        cursor = self.state.cursor
        if tuple(slot) != (cursor.dp_rank, cursor.dp_size):
            return f"it would read data slot {tuple(slot)}, and its cursor reads {(cursor.dp_rank, cursor.dp_size)}"
        return ""

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        self.weights_moved = True

    def at_boundary(self) -> None:
        """The state is a step boundary's again (a step ended, or a snapshot or checkpoint was restored)."""
        self.mid_step = self.weights_moved = False

    def _rng_state(self) -> tuple:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def _set_rng_state(self, state: tuple) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)

    def _error_feedback(self) -> list:
        """What compression held back on this rank, one holder per stage module: PowerSGD's and top-k's hooks,
        or 1-bit Adam's optimizers (``feedback``); empty when nothing is compressed with error feedback."""
        if self.spec.parallel.grad_compression in WITH_FEEDBACK:
            return [r.hook for r in self.parts.reducers]
        return [opt.feedback for opt in self.state.optimizers if isinstance(opt, OneBitAdam)]

    def _feedback_layout(self) -> str:
        """What decides which tensors a rank's error feedback belongs to, naming its checkpoint entry: the layout,
        and for PowerSGD's and top-k's (one residual per gradient bucket) how the gradients are bucketed, since
        another ``parallel.bucket_mb`` may cut other buckets under the same indices (a residual of one size added
        to a bucket of another failed the step; of equal sizes, it went to other parameters). The buckets are
        named by their sizes in elements: cut from the same ordered parameters, equal sizes are equal buckets,
        so a bucket_mb change that cuts the same buckets keeps the feedback. Another entry name: the feedback
        starts at zero, as at another layout."""
        par = self.spec.parallel
        layout = f"dp{par.dp}.pp{par.pp}.tp{par.tp}.cp{par.grid.cp}.ep{par.grid.ep}.v{par.stages_per_rank}"
        if par.grad_compression not in WITH_FEEDBACK:
            return layout
        sizes = [[sum(p.numel() for p in b.params) for b in r.buckets] for r in self.parts.reducers]
        return f"{layout}.buckets{zlib.crc32(repr(sizes).encode()):08x}"

    def _train_state(self) -> TrainState:
        """Optimizers, LR schedulers, data cursor and loss scaler around the built model parts."""
        par, optim = self.spec.parallel, self.spec.optim
        # ZeRO-1: each part's optimizer steps this rank's slices of the part's parameters (distributed_optimizer.py)
        dp_mesh = data_parallel_mesh(self.mesh, par.grid)  # dp, or dp x cp: the ranks gradients are averaged over
        sliced = self.parts.modules if par.zero == 1 and dp_mesh.size() > 1 else []
        dp_dim, replicate = shard_dim(par.grid), "dp_replicate" if par.grid.hybrid else None
        held = frozenset(id(p) for e in self.parts.experts for p in e.parameters())  # sliced over edp instead
        reduce = torch.bfloat16 if par.grad_reduce_dtype == "bf16" else torch.float32
        averaged = bool(self.parts.reducers)  # grad_compression at ZeRO-1: ZeRO-0's buckets average in backward
        self.zero1 = [sliced_optimizer(unwrap(m).named_parameters(), self.mesh, dp_dim, held, self.parts.expert_mesh,
                                       replicate, reduce, par.param_gather_dtype, averaged) for m in sliced]
        if self.zero1 and held:  # the clip reads the experts' slices: summed over ep, as their weights would be
            names = {n for m in sliced for n, p in unwrap(m).named_parameters() if id(p) in held}
            shards = [s for z in self.zero1 for n, s in z.shards.items() if n in names]
            self.expert_norm = (shards, self.parts.expert_norm_group)
        stepped = [list(z.shards.items()) for z in self.zero1] or [list(unwrap(m).named_parameters())
                                                                   for m in self.parts.modules]
        dp = dp_mesh.get_group() if dp_mesh.size() > 1 else None  # onebit_adam's momentum average
        offload = self.spec.memory.offload
        optimizers = [build_optimizer([p for _, p in named], optim, offload, self.device, self.param_offload,
                                      dp_group=dp, names=[n for n, _ in named]) for named in stepped]
        steps = self.spec.train.steps
        schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(optim, steps)) for o in optimizers]
        precision, data = self.spec.precision, self.spec.data
        scaler = DynamicLossScaler(precision.initial_loss_scale) if precision.dtype == "fp16" else None
        dataset = open_data(data.path, data.sources() if data.mix else None, self.spec.model.seq_len, data.seed)
        dp_rank, dp_size = self.spec.data_slot or (self.coords.dp, par.dp)  # a keep_training survivor: its own
        cursor = DataCursor(dataset, self.spec.train.global_batch_size, dp_rank, dp_size,
                            cp_rank=self.coords.cp, cp_size=par.grid.cp,
                            eos_id=document_eos(self.spec.model.attention_mask, dataset))
        named = [z.module() for z in self.zero1] or None
        state = TrainState(self.parts.modules, optimizers, schedulers, cursor, scaler, self.param_offload, named,
                           self.parts.expert_mesh)
        state.refresh = [z.all_gather for z in self.zero1 if z.masters_apart]  # parallel.param_gather_dtype
        return state

    def train_step(self, fault: dict | None = None) -> StepResult:
        """One optimizer step (or asp/ssp round); returns its loss, time per phase (``StepEngine.step`` says
        what each phase covers), memory and the hooks' figures for the controller."""
        ctx = StepContext(self.state, self.hooks, StepFault(fault))
        self.mid_step = True
        core = self.engine.step(ctx, self.objective)
        self.hooks.after_step(ctx)
        self.at_boundary()
        return StepResult(rank=self.rank, step=self.step, **core, peak_memory_bytes=self.peak_memory_bytes(),
                          current_memory_bytes=self.current_memory_bytes(), extras=ctx.extras)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    @property
    def step(self) -> int:
        return self.state.step

    def close_stores(self) -> None:
        """Remove this rank's offload files now (stores also clean up at process exit, which ``ray.kill`` skips)."""
        stores = [getattr(o, "store", None) for o in self.state.optimizers]
        stores += [self.activations.store, self.param_offload]
        for store in stores:
            if store is not None:
                store.close()

    def peak_memory_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        # VmHWM is this address space's high-water mark. ru_maxrss is not: across fork/vfork + exec Linux
        # carries the parent's peak into it, so a probe started from a 1.5 GB pytest reported 1.5 GB.
        # Never report a peak below current (the kernel updates the mark lazily).
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        return max(hwm, self.current_memory_bytes())

    def current_memory_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
