"""Bytes each mesh dimension moves in a step: every collective this rank issues, counted as it is issued.

Why a dispatch mode: raymesh's collectives come from several libraries (FSDP2's all-gathers and
reduce-scatters, DTensor's functional collectives for tensor parallelism, the pipeline schedules' sends, our
gradient buckets and compression hooks, the grad-norm all-reduces); all of them reach the dispatcher as
``c10d`` or ``_c10d_functional`` ops carrying their tensors and process group, so one
``TorchDispatchMode`` sees them all without patching any of them. Autograd runs backward with the
caller's dispatch modes, so collectives launched from backward hooks are seen too. raymesh's own operators
(context-parallel attention, ``workers.model.attention_ops``) would hide theirs (the mode is off while it handles an
operator), so the mode runs their implementations with itself on.

What is counted: the bytes this rank *sends* under the ring algorithms that the planner's model assumes
(``ring_bytes``): an all-reduce of S bytes over N ranks sends 2(N-1)/N·S, an all-gather (N-1)/N of its
output, a reduce-scatter (N-1)/N of its input, an all-to-all (N-1)/N of its input, a broadcast (N-1)/N·S,
a send its tensor; a receive sends nothing. A collective over a group that is no mesh dimension counts
under ``other``.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from workers.model.attention_ops import IMPLEMENTATIONS

# op name (without namespace/overload) -> (kind, index of the argument whose tensors are the payload)
_OPS = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "all_reduce": ("all_reduce", 0), "all_reduce_": ("all_reduce", 0), "all_reduce_coalesced": ("all_reduce", 0),
    "all_reduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 1), "allgather_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1), "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_into_tensor_coalesced": ("all_gather", 0), "all_gather_into_tensor_out": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1), "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1), "all_to_all_single": ("all_to_all", 0),
    "broadcast_": ("broadcast", 0), "broadcast": ("broadcast", 0),
    "send": ("send", 0),
}


def ring_bytes(kind: str, payload: int, n: int) -> int:
    """Bytes one rank sends for a collective of ``kind`` whose own tensors hold ``payload`` bytes, on ``n`` ranks
    (for an all-gather ``payload`` is this rank's input, so the output is n times it)."""
    if kind == "send":
        return payload
    if n <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (n - 1) * payload // n
    if kind == "all_gather":
        return (n - 1) * payload
    return (n - 1) * payload // n  # reduce_scatter, all_to_all, broadcast


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _group_name(args) -> str | None:
    """The process group's name: a ``c10d`` op carries the group object, a functional one its name (last str)."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            return dist.ProcessGroup.unbox(a).group_name
    names = [a for a in args if isinstance(a, str)]
    return names[-1] if names else None


class CommBytes(TorchDispatchMode):
    """Inside ``with``: counts the bytes each collective sends (``ring_bytes``), per mesh dimension.

    ``dims`` maps a process group's name to its mesh dimension (``mesh_dim_groups``); ``names`` are the
    dimensions every count lists, zeros included.
    """

    def __init__(self, dims: dict[str, str], names: tuple[str, ...]):
        super().__init__()
        self.dims, self.names = dims, names
        self.counts: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor dispatches first and issues the plain collectives we count
        inside = IMPLEMENTATIONS.get(func._schema.name)
        if inside is not None:  # a raymesh operator (cp attention): count the collectives it issues inside
            with self:
                return inside(*args, **(kwargs or {}))
        op = _OPS.get(func._opname) if func.namespace in ("c10d", "_c10d_functional") else None
        if op is not None:
            kind, where = op
            name = _group_name(args)
            group = dist.distributed_c10d._resolve_process_group(name) if name is not None else None
            n = group.size() if group is not None else 1
            self.counts[self.dims.get(name, "other")] += ring_bytes(kind, _tensor_bytes(args[where]), n)
        return func(*args, **(kwargs or {}))

    def take(self) -> dict[str, int]:
        """This step's counts (every dimension present, zeros included), and start counting afresh."""
        out = {dim: self.counts.get(dim, 0) for dim in self.names}
        out.update({k: v for k, v in self.counts.items() if k not in out})
        self.counts = defaultdict(int)
        return out


def mesh_dim_groups(mesh, data_parallel=None) -> dict[str, str]:
    """Group name -> mesh dimension for ``mesh``; a group shared by several dimensions goes to the largest one
    (a size-1 dimension moves nothing, so the one that moves bytes names the group).

    ``data_parallel``: the mesh gradients are reduced over (``process_group.data_parallel_mesh``). Under
    context parallelism that is dp x cp flattened, a group of no single dimension: its bytes are the
    data-parallel reduction, so they count under ``dp`` (not ``other``), as the planner predicts them."""
    out: dict[str, str] = {}
    for dim in sorted(mesh.mesh_dim_names, key=lambda d: mesh[d].size()):
        out[mesh.get_group(dim).group_name] = dim
    if data_parallel is not None and data_parallel.size() > 1:
        out[data_parallel.get_group().group_name] = "dp"
    return out
