"""Builds this rank's share of the model: stages, then TP/SP, recompute, then data parallel.

Every rank first builds the full model from the job seed, so the initial
weights are identical to the single-process reference whatever the layout;
each rank then keeps only its stages and shards. (Fine for the reference
sizes; a meta-device init is the path for models that do not fit one host.)

The order of steps is the builder's; how each step applies to a model is the
family's (``workers.model.registry`` hooks for ``model.arch``), so a new family
plugs in without editing this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from workers.model.finetune import prepare_model
from workers.model.hf_io import load_hf_weights
from workers.model.lora import freeze_base
from workers.parallel.data_parallel import apply_data_parallel, unwrap
from workers.parallel.layout import stage_ids
from workers.parallel.recompute import apply_recompute
from workers.spec import WorkerSpec


@dataclass
class ModelParts:
    modules: list[nn.Module]  # wrapped stage modules, in stage order
    stage_ids: list[int]
    n_stages: int


def build_parts(spec: WorkerSpec, mesh: DeviceMesh, device: torch.device) -> ModelParts:
    par, grid, fam = spec.parallel, spec.parallel.grid, spec.model_family
    torch.manual_seed(spec.train.seed)
    full = fam.build(spec.model)
    if spec.init_from and spec.lora:  # adapters and NF4 need the base weights first: read whole, before the cut
        load_hf_weights(full, spec.init_from)
    if spec.lora:
        prepare_model(full, spec.lora)
    n_stages = grid.pp * par.virtual_stages
    ids = stage_ids(mesh["pp"].get_local_rank(), grid.pp, par.virtual_stages, par.pp_schedule)
    cut = fam.hook("cut_stage")
    parts = [full] if n_stages == 1 else [cut(full, sid, n_stages) for sid in ids]
    wrapped = []
    for part in parts:
        part.to(device)
        if grid.tp_enabled:
            fam.hook("tensor_parallel")(part, mesh["tp"], par.sequence_parallel)
            if spec.lora:
                freeze_base(part)
        apply_recompute(part, spec.memory.recompute, fam)
        ps = par.dp_sync == "ps"  # parameter-server shards, not a wrapper, keep data ranks in step
        wrapped.append(part if ps else apply_data_parallel(part, fam.hook("blocks")(part), mesh["dp"], par.zero))
        if spec.init_from and not spec.lora:  # each rank reads only the slices it keeps
            load_hf_weights(unwrap(wrapped[-1]), spec.init_from)
    return ModelParts(modules=wrapped, stage_ids=ids, n_stages=n_stages)
