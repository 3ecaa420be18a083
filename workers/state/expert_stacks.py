"""Expert weights in checkpoints as the whole ``[E, ...]`` stack, so DCP reshards them to any ``parallel.ep``.

Under expert parallelism a rank holds rows ``[first, first + num_local)`` of each stacked expert weight
(``workers.parallel.expert_parallel``), as a plain tensor (ZeRO-0) or a DTensor over ``edp`` (its FSDP2 shard
under ZeRO-2/3, its ZeRO-1 optimizer slice) whose global shape is only the ep rank's rows. Handed to DCP like
that, every ep rank would claim to be the whole tensor under the weight's name: a job at another ep, ep=1
included, finds a tensor of the wrong shape or keys it does not have. Here each such entry of the model and
optimizer state (weight, moments) is handed to DCP as a DTensor of the full stack instead: ``Shard(0)`` over the
expert mesh's ``ep`` dim first (ep index i holds the i-th run of ``E / ep`` experts, as ``keep_rows`` cut
them), then the entry's own placements. DCP then writes each expert's rows once, under the name and global shape
an ep=1 run (and the exports' one-process read) uses, and reads back whichever rows a rank of any layout holds.

Under expert tensor parallelism (``parallel.expert_tp``) a rank's rows also hold only its tp slice of each
expert's hidden (w1/w3's columns, w2's rows): the full stack then has ``Shard(hidden dim)`` over the expert
mesh's ``tp`` dim after ``ep``'s ``Shard(0)``, so a job with or without expert_tp, at any ep, reads it back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from workers.model.moe import HIDDEN_DIM, moe_layers


@dataclass(frozen=True)
class Stack:
    """A stacked expert weight a rank holds part of: the full stack's shape, and the dim split over tp (expert
    tensor parallelism) or None."""

    shape: tuple[int, ...]
    hidden_dim: int | None = None


def sharded_experts(modules: Iterable[nn.Module]) -> dict[str, Stack]:
    """The full stack, per full name of a stacked weight split over ep (empty at ep=1)."""
    out = {}
    for name, layer in moe_layers(list(modules)).items():
        experts = layer.experts
        if experts.num_local != experts.num_experts:
            held = experts.held_rows
            for param, value in experts.named_parameters(recurse=False):
                split = HIDDEN_DIM[param] if held.hidden_full is not None else None
                out[f"{name}.experts.{param}"] = Stack(held.full_shape(param, tuple(value.shape)), split)
    return out


def _expert_weight(key: str, experts: dict[str, Stack]) -> str | None:
    """The expert weight ``key`` belongs to: the key itself (model) or ``state.<weight>.<stat>`` (optimizer)."""
    if key in experts:
        return key
    if key.startswith("state."):
        weight = key[len("state."):].rpartition(".")[0]
        return weight if weight in experts else None
    return None


def _stacked(key: str, value, experts: dict[str, Stack]) -> str | None:
    """The expert weight of an entry held as rows of its stack (not a scalar such as Adam's step), else None."""
    weight = _expert_weight(key, experts)
    return weight if weight is not None and isinstance(value, torch.Tensor) and value.dim() > 0 else None


def _full_placement(value: torch.Tensor, expert_mesh: DeviceMesh, stack: Stack) -> tuple[DeviceMesh, tuple]:
    """The full stack's mesh and placements: ``Shard(0)`` over ep, ``Shard(hidden dim)`` over tp under expert
    tensor parallelism, then the entry's own (a DTensor's mesh dims are dims of the expert mesh: ``edp``)."""
    dims, placements = ("ep",), (Shard(0),)
    if stack.hidden_dim is not None:
        dims, placements = (*dims, "tp"), (*placements, Shard(stack.hidden_dim))
    if isinstance(value, DTensor):
        dims, placements = (*dims, *value.device_mesh.mesh_dim_names), (*placements, *value.placements)
    return (expert_mesh[dims[0]] if len(dims) == 1 else mesh_in_order(expert_mesh, dims)), placements


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def whole(state: dict, experts: dict[str, Stack], expert_mesh: DeviceMesh) -> dict:
    """``state`` (flat model or optimizer dict) with every expert entry a DTensor of the full ``[E, ...]`` stack
    over this rank's rows (a view: DCP's load writes into the entry itself)."""
    out = dict(state)
    for key, value in state.items():
        weight = _stacked(key, value, experts)
        if weight is not None:
            mesh, placements = _full_placement(value, expert_mesh, experts[weight])
            shape = torch.Size(experts[weight].shape)
            out[key] = DTensor.from_local(_local(value), mesh, placements, run_check=False, shape=shape,
                                          stride=torch.empty(shape, device="meta").stride())
    return out


def held(state: dict, like: dict, experts: dict[str, Stack]) -> dict:
    """Undo ``whole``: each expert entry shaped and placed as in ``like`` (this rank's current dict) again."""
    out = dict(state)
    for key, value in like.items():
        if _stacked(key, value, experts) is None:
            continue
        rows = _local(out[key])
        out[key] = DTensor.from_local(rows, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                      stride=value.stride()) if isinstance(value, DTensor) else rows
    return out


def mesh_in_order(root: DeviceMesh, dims: tuple[str, ...]) -> DeviceMesh:
    """The sub-mesh of ``root`` over ``dims`` in the order given, on the root's own groups.

    ``root[dims]`` refuses dims out of the root's order, and a DTensor's placements shard left to right over its
    mesh dims: a tensor split first over an inner dim of the root (an ep rank's expert rows of the full stack,
    then cut over the outer ``edp``) needs that dim first.
    """
    ascending = tuple(sorted(dims, key=root.mesh_dim_names.index))
    ranks = root[ascending].mesh.permute(*(ascending.index(d) for d in dims))
    groups = [root[d].get_group() for d in dims]
    return DeviceMesh.from_group(groups, root.device_type, mesh=ranks, mesh_dim_names=dims)
