"""ZeRO-1 as Megatron's distributed optimizer: each data-parallel rank steps only its slice of every parameter.

Why our own and not ``ZeroRedundancyOptimizer``: that one assigns whole parameters to ranks and needs DDP's
all-reduce first, so it cannot take tensor-parallel (DTensor) parameters, and DDP's reducer breaks under a
pipeline schedule's one backward per microbatch. Here no wrapper touches backward: gradients accumulate
locally over microbatches (plain or pipelined), then

1. ``reduce_scatter`` copies every trainable parameter's *local* gradient (a DTensor's local shard under
   tp) into one flat buffer laid out by data-parallel rank, and one ``reduce_scatter_tensor`` over the dp
   group leaves each rank the dp-mean of its own slices: the first rows (dim 0) of each local tensor,
   chunked as ``torch.chunk``/DTensor's ``Shard`` would (``dim0_chunk``);
2. the job's ordinary optimizer (AdamW, SGD, SM3, the offloaded Adam...) steps ``shards``: one
   ``nn.Parameter`` per parameter, a view of its local rows, so the fp32 parameter is its own master and
   the optimizer state exists for the slice only;
3. ``all_gather`` sends the updated rows back with one ``all_gather_into_tensor`` of the same layout.

With ``parallel.param_gather_dtype`` bf16 or int8 (ZeRO++'s quantized weights, ``quantized_gather.py``) the rows
travel in that dtype and every rank, the owner included, computes with the dequantized values, so replicas stay
identical; the shard is then its own fp32 tensor (not a view of the rows), the master the optimizer steps and
checkpoints save, so the rounding never accumulates.

With ``parallel.grad_compression`` ``powersgd`` or ``topk`` (``averaged``) ZeRO-0's gradient buckets
(``grad_buckets.py``) average the gradients over dp in backward through the compressed all-reduce hook, error
feedback and all, so every rank holds the same approximated average of the whole gradient; step 1 then only
copies this rank's rows of it into the shards, with no collective: the compressed all-reduce replaces the
reduce-scatter (and under hybrid sharding the replicas' all-reduce), and the rest is unchanged.

Each shard is a DTensor placed like its parameter plus ``Shard(0)`` over dp, on a mesh ordered (tp, dp):
tp splits the global tensor first, then dp splits the tp-local rows, which is exactly how the slice was cut.
So the global-norm clip (``workers.optim.build.global_grad_norm``) sums each slice once over dp and tp, and
DCP saves the state under every parameter's global name and shape, resharding it on load to any dp (or
to zero 0/2/3, whose state has the same keys and shapes).

Under expert parallelism the dp ranks hold different experts, so ``sliced_optimizer`` slices a part's expert
weights with a second ``DistributedOptimizer`` over the expert-data-parallel group (``edp``: the ``dp / ep``
ranks holding the same experts, over which their gradients are averaged, as ``grad_buckets.py`` does at
ZeRO-0) and everything else over dp; ``SlicedParts`` steps both as one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from workers.parallel import quantized_gather


def dim0_chunk(rows: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of chunk ``index`` of ``rows`` rows cut in ``parts``: ``torch.chunk``'s rule (chunks of
    ceil(rows/parts), the last ones shorter or empty), which is how DTensor places ``Shard(0)``."""
    size = -(-rows // parts)
    start = min(rows, size * index)
    return start, min(rows, start + size)


@dataclass
class _Slot:
    """One parameter's place in the flat buffer: ``width`` elements per dp rank (padded), from ``offset``."""

    param: nn.Parameter
    shard: nn.Parameter
    offset: int
    width: int

    @property
    def local(self) -> torch.Tensor:
        return self.param.to_local() if isinstance(self.param, DTensor) else self.param


class DistributedOptimizer:
    """This dp rank's slices of ``named_params`` (the trainable ones), and the collectives around its step.

    ``shards`` (name → shard parameter) is what the job's optimizer is built over, what checkpoints name
    (``module``) and what the global-norm clip reads.
    """

    def __init__(self, named_params, root_mesh: DeviceMesh, dp_dim: str = "dp", replicate_dim: str | None = None,
                 reduce_dtype: torch.dtype = torch.float32, gather_dtype: str = "fp32", averaged: bool = False):
        self.dp_mesh, self._dp_dim = root_mesh[dp_dim], dp_dim  # "dp_cp" under context parallelism
        self.group = self.dp_mesh.get_group()
        self.dp, self.index = self.dp_mesh.size(), self.dp_mesh.get_local_rank()
        # hybrid sharding: the slices are cut over the shard group ``dp_dim`` and each is held by every replica
        replicas = root_mesh[replicate_dim] if replicate_dim else None
        self.replicate_group = replicas.get_group() if replicas is not None and replicas.size() > 1 else None
        self.replicas = replicas.size() if replicas is not None else 1
        self.reduce_dtype = reduce_dtype  # parallel.grad_reduce_dtype: what the reduce-scatter moves
        self.gather_dtype = gather_dtype  # parallel.param_gather_dtype: what the all-gather moves
        self.averaged = averaged  # grad_compression: the gradients arrive averaged over dp (module doc)
        self._root, self._meshes = root_mesh, {}
        self.slots: dict[str, _Slot] = {}
        offset = 0
        for name, p in named_params:
            if p.requires_grad:
                slot = self._slot(name, p, offset)
                self.slots[name] = slot
                offset += slot.width
        self.width = offset

    @property
    def shards(self) -> dict[str, nn.Parameter]:
        return {name: slot.shard for name, slot in self.slots.items()}

    @property
    def masters_apart(self) -> bool:
        """Whether the shards are fp32 masters apart from the parameters (a lossy gather): then checkpoints save
        the shards' values and a load gathers them back into the parameters (``TrainState.refresh``)."""
        return self.gather_dtype != "fp32"

    def _slot(self, name: str, p: nn.Parameter, offset: int) -> _Slot:
        local = p.to_local() if isinstance(p, DTensor) else p.data
        if local.dim() == 0:
            raise ValueError(f"parameter {name!r} is a scalar, which ZeRO-1 cannot slice by rows; "
                             "fix: give it shape (1,), or use parallel.zero: 0")
        rows, row = local.shape[0], local[0].numel() if local.shape[0] else 0
        start, stop = dim0_chunk(rows, self.dp, self.index)
        mesh, placements = self._placement(p)
        view = local.detach()[start:stop]
        if self.masters_apart:  # the rows will hold dequantized values; the master keeps the exact ones
            view = view.clone()
        shard = nn.Parameter(DTensor.from_local(view, mesh, placements, run_check=False, shape=p.shape,
                                                stride=p.stride()))
        return _Slot(p, shard, offset, -(-rows // self.dp) * row)

    def _placement(self, p: nn.Parameter) -> tuple[DeviceMesh, tuple]:
        """The shard's mesh and placements: the parameter's own, then ``Shard(0)`` over dp (see module doc)."""
        if not isinstance(p, DTensor):
            return self.dp_mesh, (Shard(0),)
        names = p.device_mesh.mesh_dim_names
        if names not in self._meshes:
            ranks = self._root[(self._dp_dim, *names)].mesh  # dp (dp x cp) is outermost: slicing keeps that order
            ranks = ranks.permute(*range(1, ranks.dim()), 0)
            groups = [p.device_mesh.get_group(i) for i in range(len(names))] + [self.group]
            self._meshes[names] = DeviceMesh.from_group(groups, self.dp_mesh.device_type, mesh=ranks,
                                                        mesh_dim_names=(*names, "dp"))
        return self._meshes[names], (*p.placements, Shard(0))

    def _buffer(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(self.dp * self.width, dtype=dtype, device=self.dp_mesh.device_type)

    def reduce_scatter(self) -> None:
        """Average the gradients over dp into the shards' ``.grad`` (the model's gradients stay as they are
        until ``zero_grad``; a parameter without a gradient counts as zeros); ``averaged``: they are averaged
        already, so this rank's rows are only copied."""
        # bf16 (parallel.grad_reduce_dtype): half the bytes, summed in bf16
        flat = self._buffer(torch.float32 if self.averaged else self.reduce_dtype)
        for slot in self.slots.values():
            grad = slot.param.grad
            if grad is not None:
                _scatter_rows(_local_grad(slot.param, grad), flat, slot, self.dp, self.width)
        if self.averaged:
            out = flat.view(self.dp, self.width)[self.index]
        else:
            out = torch.empty(self.width, dtype=flat.dtype, device=flat.device)
            dist.reduce_scatter_tensor(out, flat, group=self.group)
            if self.replicate_group is not None:  # the replicas' sums of the same slice: only the shard crosses
                dist.all_reduce(out, group=self.replicate_group)
            out = out.float().div_(self.dp * self.replicas)
        del flat
        for slot in self.slots.values():
            local = _local(slot.shard)
            g = out[slot.offset:slot.offset + local.numel()].view(local.shape).to(local.dtype)
            slot.shard.grad = DTensor.from_local(g, slot.shard.device_mesh, slot.shard.placements, run_check=False,
                                                 shape=slot.shard.shape, stride=slot.shard.stride())

    @torch.no_grad()
    def all_gather(self) -> None:
        """Every dp rank's updated rows back into every rank's parameters (through ``gather_dtype`` on the wire:
        every rank, this one included, then holds the same dequantized rows)."""
        mine = torch.zeros(self.width, dtype=torch.float32, device=self.dp_mesh.device_type)
        for slot in self.slots.values():
            local = _local(slot.shard)
            mine[slot.offset:slot.offset + local.numel()].copy_(local.reshape(-1))
        flat = quantized_gather.gather(mine, self.gather_dtype, self.group)
        for slot in self.slots.values():
            _gather_rows(flat, slot.local, slot, self.dp, self.width)

    def zero_grad(self) -> None:
        """The model's gradients (the job's optimizer clears the shards' own)."""
        for slot in self.slots.values():
            slot.param.grad = None

    def module(self) -> nn.Module:
        return shards_module(self.shards)


def shards_module(shards: dict[str, nn.Parameter]) -> nn.Module:
    """The shards under their parameters' names, for DCP's state-dict helpers (they name optimizer state by a
    module's parameter names; the shards belong to no module of their own)."""
    root = nn.Module()
    for name, shard in shards.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, shard)
    return root


class SlicedParts:
    """Several ``DistributedOptimizer``s over disjoint parameters of one model part (dense weights over dp,
    expert weights over edp), with the one optimizer interface the trainer drives."""

    def __init__(self, slicers: list[DistributedOptimizer]):
        self.slicers = slicers

    @property
    def shards(self) -> dict[str, nn.Parameter]:
        return {name: shard for slicer in self.slicers for name, shard in slicer.shards.items()}

    def reduce_scatter(self) -> None:
        for slicer in self.slicers:
            slicer.reduce_scatter()

    def all_gather(self) -> None:
        for slicer in self.slicers:
            slicer.all_gather()

    def zero_grad(self) -> None:
        for slicer in self.slicers:
            slicer.zero_grad()

    @property
    def masters_apart(self) -> bool:
        return any(slicer.masters_apart for slicer in self.slicers)

    def module(self) -> nn.Module:
        return shards_module(self.shards)


def sliced_optimizer(named_params, root_mesh: DeviceMesh, dp_dim: str, expert_ids: frozenset[int] = frozenset(),
                     expert_mesh: DeviceMesh | None = None,
                     replicate_dim: str | None = None,
                     reduce_dtype: torch.dtype = torch.float32,
                     gather_dtype: str = "fp32", averaged: bool = False) -> DistributedOptimizer | SlicedParts:
    """ZeRO-1 for one model part: its parameters sliced over ``dp_dim`` of ``root_mesh`` (and, under hybrid
    sharding, their reduced slices all-reduced over ``replicate_dim``), but those in ``expert_ids``
    (expert-parallel experts) over ``edp`` of ``expert_mesh`` (see the module docstring)."""
    named = list(named_params)
    if expert_mesh is None or not expert_ids:
        return DistributedOptimizer(named, root_mesh, dp_dim, replicate_dim, reduce_dtype, gather_dtype, averaged)
    dense = [(n, p) for n, p in named if id(p) not in expert_ids]
    experts = [(n, p) for n, p in named if id(p) in expert_ids]
    return SlicedParts([DistributedOptimizer(dense, root_mesh, dp_dim, gather_dtype=gather_dtype),
                        DistributedOptimizer(experts, expert_mesh, "edp", gather_dtype=gather_dtype)])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_grad(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """A gradient's local tensor placed like its parameter (a pending tp sum, ``Partial``, is reduced first)."""
    if isinstance(grad, DTensor):
        if grad.placements != param.placements:
            grad = grad.redistribute(param.device_mesh, param.placements)
        return grad.to_local()
    return grad


def _rank_view(flat: torch.Tensor, slot: _Slot, dp: int, width: int) -> torch.Tensor:
    """``(dp, slot.width)``: each dp rank's slot of this parameter in the flat buffer."""
    return flat.view(dp, width)[:, slot.offset:slot.offset + slot.width]


def _scatter_rows(local: torch.Tensor, flat: torch.Tensor, slot: _Slot, dp: int, width: int) -> None:
    """Copy ``local`` (the whole local tensor) into the buffer: rank d's rows into rank d's slot."""
    src, dst = local.reshape(-1), _rank_view(flat, slot, dp, width)
    full = src.numel() // slot.width if slot.width else 0
    dst[:full].copy_(src[:full * slot.width].view(full, slot.width))
    rest = src.numel() - full * slot.width
    if rest:
        dst[full, :rest].copy_(src[full * slot.width:])


def _gather_rows(flat: torch.Tensor, local: torch.Tensor, slot: _Slot, dp: int, width: int) -> None:
    """The reverse of ``_scatter_rows``: every rank's slot back into the rows of ``local``."""
    dst, src = local.view(-1), _rank_view(flat, slot, dp, width)
    full = dst.numel() // slot.width if slot.width else 0
    dst[:full * slot.width].view(full, slot.width).copy_(src[:full])
    rest = dst.numel() - full * slot.width
    if rest:
        dst[full * slot.width:].copy_(src[full, :rest])
