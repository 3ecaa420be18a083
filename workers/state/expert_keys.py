"""One checkpoint key per expert, so a state saved at one ``parallel.ep`` loads at another.

Under expert parallelism a rank holds rows ``[first, first + num_local)`` of each stacked expert weight
(``workers.parallel.expert_parallel``), as a plain tensor (ZeRO-0) or its edp shard (FSDP2, ZeRO-2/3), under
the same name on every rank. DCP would take those for copies of one tensor. Here each held row of a model or
optimizer entry of an expert weight becomes its own key, ``<name>.expert<e>`` with ``e`` the GLOBAL expert id:
DCP writes each expert once (ranks holding the same expert dedup) and a rank at another ep reads the experts it
now holds. Why per-expert keys and not a DTensor sharded over ep: under ZeRO-2/3 the rows are already a DTensor
sharded over edp, and describing the two nested shardings to DCP needs PyTorch's private strided placements.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from workers.model.moe import moe_layers


def sharded_experts(modules: Iterable[nn.Module]) -> dict[str, int]:
    """Global id of local row 0, per full name of an expert-parallel stacked weight (empty at ep=1)."""
    out = {}
    for name, layer in moe_layers(list(modules)).items():
        experts = layer.experts
        if experts.num_local != experts.num_experts:
            for param, _ in experts.named_parameters(recurse=False):
                out[f"{name}.experts.{param}"] = experts.first
    return out


def _expert_weight(key: str, experts: dict[str, int]) -> str | None:
    """The expert weight ``key`` belongs to: the key itself (model) or ``state.<weight>.<stat>`` (optimizer)."""
    if key in experts:
        return key
    if key.startswith("state."):
        weight = key[len("state."):].rpartition(".")[0]
        return weight if weight in experts else None
    return None


def _rows(value: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The rows this rank holds and the index of the first among the rank's ``num_local``."""
    if not isinstance(value, DTensor):
        return value, 0
    _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return value.to_local(), offset[0]


def split(state: dict, experts: dict[str, int]) -> dict:
    """``state`` (flat model or optimizer dict) with every expert entry split into per-expert row views."""
    out = {}
    for key, value in state.items():
        weight = _expert_weight(key, experts)
        if weight is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
            out[key] = value
            continue
        rows, at = _rows(value)
        for j in range(rows.shape[0]):
            out[f"{key}.expert{experts[weight] + at + j}"] = rows[j]
    return out


def join(state: dict, like: dict, experts: dict[str, int]) -> dict:
    """Undo ``split``: entries shaped as in ``like`` (this rank's current dict) from their per-expert rows."""
    out = dict(state)
    for key, value in like.items():
        weight = _expert_weight(key, experts)
        if weight is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        rows, at = _rows(value)
        first = experts[weight] + at
        held = [out.pop(f"{key}.expert{first + j}") for j in range(rows.shape[0])]
        stacked = torch.stack(held) if held else rows.clone()
        if isinstance(value, DTensor):
            stacked = DTensor.from_local(stacked, value.device_mesh, value.placements, run_check=False,
                                         shape=value.shape, stride=value.stride())
        out[key] = stacked
    return out
