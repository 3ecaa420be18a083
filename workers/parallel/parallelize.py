"""Builds this rank's share of the model: stages, then TP/SP, recompute, then data parallel.

Every rank first builds the full model from the job seed, so the initial
weights are identical to the single-process reference whatever the layout;
each rank then keeps only its stages and shards. (Fine for the reference
sizes; a meta-device init is the path for models that do not fit one host.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from workers.model.config import model_config
from workers.model.finetune import prepare_model
from workers.model.lora import freeze_base
from workers.model.registry import build_model
from workers.parallel.data_parallel import apply_data_parallel
from workers.parallel.grid import Grid
from workers.parallel.layout import stage_ids
from workers.parallel.pipeline import cut_stage
from workers.parallel.recompute import apply_recompute
from workers.parallel.tensor_parallel import apply_tensor_parallel


@dataclass
class ModelParts:
    modules: list[nn.Module]  # wrapped stage modules, in stage order
    stage_ids: list[int]
    n_stages: int


def build_parts(spec: dict, mesh: DeviceMesh, device: torch.device) -> ModelParts:
    par = spec["parallel"]
    torch.manual_seed(spec["train"]["seed"])
    full = build_model(model_config(spec["model"]))
    lora = spec["model"].get("lora")
    if lora:
        prepare_model(full, lora)
    grid = Grid.from_parallel(par)
    n_stages = grid.pp * par["virtual_stages"]
    ids = stage_ids(mesh["pp"].get_local_rank(), grid.pp, par["virtual_stages"], par["pp_schedule"])
    parts = [full] if n_stages == 1 else [cut_stage(full, sid, n_stages) for sid in ids]
    wrapped = []
    for part in parts:
        part.to(device)
        if grid.tp_enabled:
            apply_tensor_parallel(part, mesh["tp"], par["sequence_parallel"])
            if lora:
                freeze_base(part)
        apply_recompute(part, spec["memory"]["recompute"])
        ps = par["dp_sync"] == "ps"  # parameter-server shards, not a wrapper, keep data ranks in step
        wrapped.append(part if ps else apply_data_parallel(part, mesh["dp"], par["zero"]))
    return ModelParts(modules=wrapped, stage_ids=ids, n_stages=n_stages)
