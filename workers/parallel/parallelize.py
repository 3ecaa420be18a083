"""Builds this rank's share of the model: stages, float8 linears (``precision.float8``), then TP/SP, context
parallel, expert sharding (ep), recompute, compile (``train.compile``), then data parallel.

Every rank builds the whole model on the ``meta`` device (no storage), cuts
its pipeline stages, applies TP and (ZeRO-2/3) FSDP2 there, and only then
materialises its own shards (``workers.model.meta_init``): host memory at
start-up is the rank's shard plus the largest single tensor, not the model.
Each parameter is drawn from a generator seeded by the job seed and its name,
so the initial weights equal the single-process reference on every layout.
DDP-style data parallelism (ZeRO-0/1) needs real parameters, so it wraps
after materialising. The model is still built whole on the host first (the
old path) for LoRA over a base (``model.lora.base_checkpoint``, or
``model.init_from`` with ``model.lora``: adapters and NF4 wrap the loaded base
weights) and for a family that registers no ``init_parameter`` hook (see
``workers.model.meta_init``). Without LoRA, ``model.init_from`` is read after
materialising, each rank reading only the slices it keeps.

The order of steps is the builder's; how each step applies to a model is the
family's (``workers.model.registry`` hooks for ``model.arch``), so a new family
plugs in without editing this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from workers.contract.schedules import schedule as schedule_facts
from workers.finetune import prepare_model
from workers.model.float8 import apply_float8, check_float8_device
from workers.model.hf_io import load_hf_weights
from workers.model.lora import freeze_base
from workers.model.meta_init import build_full, init_hook, materialize
from workers.model.moe import moe_layers
from workers.model.names import unwrap
from workers.model.registry import ModelFamily
from workers.parallel.compile import compile_blocks
from workers.parallel.context_layout import apply_context_parallel
from workers.parallel.data_parallel import apply_data_parallel, bf16_policy, reduce_policy
from workers.parallel.expert_parallel import shard_experts
from workers.parallel.fsdp_prefetch import set_prefetch
from workers.parallel.grad_buckets import GradBuckets
from workers.parallel.layout import own_stages
from workers.parallel.partitioned_activations import InputSlices
from workers.parallel.process_group import EP_TP, data_parallel_mesh, init_expert_mesh, shard_mesh
from workers.parallel.recompute import apply_recompute
from workers.spec import WorkerSpec


@dataclass
class ModelParts:
    modules: list[nn.Module]  # wrapped stage modules, in stage order
    stage_ids: list[int]
    n_stages: int
    reducers: list[GradBuckets] = field(default_factory=list)  # ZeRO-0 gradient buckets (ZeRO-1: compressed)
    experts: list[nn.Module] = field(default_factory=list)  # this rank's sharded Experts (expert parallelism)
    ep_group: Any = None  # the ep process group the experts are split over; None at ep=1
    # the ranks whose experts' gradients differ, for the norm: ep, or ep x tp under expert tensor parallelism
    expert_norm_group: Any = None
    expert_mesh: DeviceMesh | None = None  # edp x ep x position (``init_expert_mesh``); None at ep=1
    slices: InputSlices | None = None  # ZeRO-R's Pa: what keeps the recomputed blocks' input slices


def on_meta(spec: WorkerSpec, fam: ModelFamily) -> bool:
    """Whether this job's model is built on the meta device (see the module docstring for when it is not)."""
    lora, init_from = spec.finetune.lora, spec.finetune.init_from
    whole_base = lora and (lora.base_checkpoint or init_from)  # adapters/NF4 need the base first
    return init_hook(fam) is not None and not whole_base


def whole_model(spec: WorkerSpec, fam: ModelFamily, meta: bool) -> nn.Module:
    """The unsplit model, adapters on: weightless on meta, else materialised with the reference's values."""
    lora, init_from = spec.finetune.lora, spec.finetune.init_from
    if not meta:
        full = build_full(spec.model, spec.train.seed)
        if init_from and lora:  # read whole, before the cut: LoRA and NF4 wrap the base weights
            load_hf_weights(full, init_from)
    else:
        with torch.device("meta"):
            full = fam.build(spec.model)
    if lora:
        prepare_model(full, lora, spec.train.seed)
    return full


def build_parts(spec: WorkerSpec, mesh: DeviceMesh, device: torch.device) -> ModelParts:
    par, grid, fam = spec.parallel, spec.parallel.grid, spec.model_family
    torch.manual_seed(spec.train.seed)  # the global stream (dropout) starts where the reference's does
    meta = on_meta(spec, fam)
    full = whole_model(spec, fam, meta)
    n_stages, ids = own_stages(par, mesh["pp"].get_local_rank())
    parts = [full] if n_stages == 1 else [fam.hook("cut_stage")(full, sid, n_stages, par.stage_layers) for sid in ids]
    del full  # a stage keeps only its layers
    dp_mesh = data_parallel_mesh(mesh, grid)
    expert_mesh = init_expert_mesh(grid, device, spec.fault_tolerance.collective_timeout_s)
    ep_group = expert_mesh["ep"].get_group() if expert_mesh is not None else None
    expert_tp = expert_mesh["tp"].get_group() if expert_mesh is not None and par.expert_tp else None
    wrapped, all_experts = [], []
    slices = input_slices(spec, mesh)
    check_float8_device(spec.precision.float8, device)
    for part in parts:
        part.loss_chunks = spec.train.loss_chunks  # the last stage's forward then leaves the head to the loss
        # before TP and FSDP2, which then shard the swapped layers' plain weights (torchao's order)
        apply_float8(fam.hook("blocks")(part), spec.precision.float8, device,
                     fsdp=par.dp_sync != "ps" and par.zero >= 2)
        if not meta:
            part.to(device)
        if grid.tp_enabled:
            fam.hook("tensor_parallel")(part, mesh["tp"], par.sequence_parallel)
            if spec.finetune.lora:
                freeze_base(part)
        if grid.cp_enabled:
            apply_context_parallel(part, mesh["cp"], par.cp_impl)
            for layer in moe_layers([part]).values():  # whole sequences' balance loss from the cp shares
                layer.router.context_group = mesh["cp"].get_group()
        experts = shard_experts(part, ep_group, expert_tp) if ep_group is not None else []
        all_experts += experts
        apply_recompute(part, spec.memory.recompute, fam, spec.memory.recompute_every, spec.train.compile, slices)
        if spec.train.compile:  # before FSDP2, as torchtitan: its hooks then run eagerly around each block
            compile_blocks(part, fam)
            part.compile_loss = True
        ps = par.dp_sync == "ps"  # parameter-server shards, not a wrapper, keep data ranks in step
        fsdp = not ps and par.zero >= 2  # FSDP2 shards meta parameters; the DDP wrappers need real ones
        edp = expert_mesh["edp"] if expert_mesh is not None else None
        if fsdp:
            mixed = (bf16_policy(spec.precision.reduce_dtype) if spec.fsdp_mixed(device.type == "cuda")
                     else reduce_policy(par.grad_reduce_dtype))
            part = apply_data_parallel(part, fam.hook("blocks")(part), shard_mesh(mesh, grid), par.zero, experts,
                                       edp, mixed, par.fsdp_bucket_mb, par.param_gather_dtype)
            set_prefetch(fam.hook("blocks")(part), par.fsdp_prefetch)
        if meta:
            materialize(part, spec.train.seed, spec.model, device)
        if not ps and not fsdp:
            part = apply_data_parallel(part, fam.hook("blocks")(part), dp_mesh, par.zero, experts, edp)
        if spec.finetune.init_from and not spec.finetune.lora:  # each rank reads only the slices it keeps
            load_hf_weights(unwrap(part), spec.finetune.init_from)
        wrapped.append(part)
    # PipeDream's executor averages each update's gradient itself (workers.parallel.async_pipeline)
    # dp_sync diloco: no gradient crosses dp; the replicas' weights meet every H steps (workers/step/diloco.py)
    # ZeRO-1 with grad_compression: the buckets' compressed all-reduce, then each rank keeps its slice
    # (distributed_optimizer.py, ``averaged``)
    # a replicated stage's gradients are summed over its replicas by the replicated pipeline's own sync
    zero_reduces = par.zero != 0 and not (par.zero == 1 and par.grad_compression != "none")
    own_reduce = (ps or zero_reduces or par.dp_sync == "diloco" or par.stage_replicas is not None
                  or (grid.pp_enabled and schedule_facts(par.pp_schedule).asynchronous))
    reducers = [] if own_reduce else zero0_buckets(spec, fam, wrapped, dp_mesh, all_experts, edp)
    return ModelParts(modules=wrapped, stage_ids=ids, n_stages=n_stages, reducers=reducers, experts=all_experts,
                      ep_group=ep_group, expert_mesh=expert_mesh, slices=slices,
                      expert_norm_group=expert_mesh[EP_TP].get_group() if expert_tp is not None else ep_group)


def input_slices(spec: WorkerSpec, mesh: DeviceMesh) -> InputSlices | None:
    """``memory.partition_activations``: what keeps each recomputed block's input, 1/tp of it per tp rank (the
    spec checks refuse the layouts where the input is not replicated over tp)."""
    place = spec.memory.partition_activations
    if place == "none":
        return None
    return InputSlices(mesh["tp"].get_group() if spec.parallel.grid.tp_enabled else None, place,
                       spec.memory.contiguous_checkpoints)


def zero0_buckets(spec: WorkerSpec, fam: ModelFamily, parts: list[nn.Module], dp_mesh, experts: list[nn.Module],
                  edp_mesh) -> list[GradBuckets]:
    """ZeRO-0's gradient buckets: one set per stage module over dp (or dp x cp: cp ranks hold shares of the
    tokens), leaving out expert-parallel experts, whose gradients are averaged over the ranks holding the same
    experts (``edp``) by buckets of their own. The stage modules' buckets come first, one per optimizer."""
    held = frozenset(id(p) for unit in experts for p in unit.parameters())
    out = []
    if dp_mesh.size() > 1:
        out = [grad_buckets(spec, part, fam.hook("blocks")(part), dp_mesh.get_group(), held) for part in parts]
    if edp_mesh is not None and edp_mesh.size() > 1:
        out += [grad_buckets(spec, unit, [unit], edp_mesh.get_group()) for unit in experts]
    return out


def grad_buckets(spec: WorkerSpec, part: nn.Module, blocks: list[nn.Module], group,
                 skip: frozenset[int] = frozenset()) -> GradBuckets:
    """ZeRO-0's bucketed gradient averaging of one module (but the parameters in ``skip``), with the job's
    bucket size and compression."""
    par = spec.parallel
    return GradBuckets(part, blocks, group, spec.train.microbatches, bucket_mb=par.bucket_mb,
                       compression=par.grad_compression, powersgd_rank=par.powersgd_rank, topk_ratio=par.topk_ratio,
                       skip=skip, warmup_steps=par.powersgd_warmup_steps if par.grad_compression == "powersgd" else 0)
