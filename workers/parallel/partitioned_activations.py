"""ZeRO-R's partitioned activation checkpoints (Pa, seed 004 lines 97-101 and 215-222), optionally in host memory.

Under full (or ``sqrt``) recompute a block keeps only its input for backward. Without sequence parallelism that
input is the same on every tensor-parallel rank (Megatron's tp replicates the residual stream), so tp ranks keep tp
copies of it. ``memory.partition_activations`` keeps 1/tp of it on each rank instead (a flat slice, the last one
zero-padded) and all-gathers the whole input over tp when backward recomputes the block; ``host`` also puts the
slice in host memory (pinned on a GPU) and brings it back first (Pa+cpu). The gathered input is a bit-exact copy
of the forward's, so gradients are unchanged; the price is one all-gather of the input per recomputed block.

``memory.contiguous_checkpoints`` cuts every slice from one reused buffer (``Arena``) instead of allocating each.

``InputSlices`` is what ``workers.parallel.recompute.checkpoint_segment`` keeps in place of a block's input: its
``keep`` runs when the checkpoint starts (forward), its ``whole`` inside the recompute (backward). The memory
probe (``workers.diagnostics.memory_probe``) counts the slices through ``listeners``, as device or host bytes by
where this code put them (on a CPU device both are host memory: the split is the one a GPU would have).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

PLACES = ("none", "device", "host")


@dataclass(frozen=True)
class Kept:
    """One block input as kept: this rank's slice, the input's shape, and whether it needed a gradient."""

    part: torch.Tensor
    shape: torch.Size
    requires_grad: bool


class InputSlices:
    """Keeps this rank's 1/``size`` share of each checkpointed block input (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, place: str, contiguous: bool = False):
        if place not in PLACES[1:]:
            raise ValueError(f"memory.partition_activations {place!r}: InputSlices keeps slices on 'device' or "
                             "'host'; 'none' keeps whole inputs (no InputSlices)")
        self.group, self.place = group, place
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.listeners: list[Callable[[torch.Tensor, str], None]] = []
        self.arena = Arena() if contiguous else None
        self.allocations = 0  # buffers allocated for slices so far (the arena's included)

    def keep(self, x: torch.Tensor) -> Kept:
        """This rank's slice of ``x`` (a copy, so ``x`` itself can be freed), in host memory for ``host``, cut
        from the arena where there is one."""
        flat = x.detach().reshape(-1)
        per = -(-flat.numel() // self.size)
        mine = flat[self.rank * per:(self.rank + 1) * per]
        device = torch.device("cpu") if self.place == "host" else x.device
        pin = self.place == "host" and x.is_cuda
        part = self.arena.take(per, x.dtype, device, pin) if self.arena is not None else None
        if part is None:
            part = torch.empty(per, dtype=x.dtype, device=device, pin_memory=pin)
            self.allocations += 1
        elif self.arena.fresh:
            self.allocations += 1
            self.arena.fresh = False
        part[:mine.numel()].copy_(mine, non_blocking=True)
        part[mine.numel():].zero_()
        for listener in self.listeners:
            listener(part, self.place)
        return Kept(part, x.shape, x.requires_grad)

    def whole(self, kept: Kept, device: torch.device) -> torch.Tensor:
        """The block input again, gathered from every tp rank's slice (a leaf needing a gradient where the
        forward's input did, so the recompute saves what the forward saved)."""
        part = kept.part.to(device, non_blocking=True)
        if self.arena is not None:
            self.arena.give_back()
        if self.size > 1:
            out = torch.empty(part.numel() * self.size, dtype=part.dtype, device=device)
            dist.all_gather_into_tensor(out, part, group=self.group)
        else:
            out = part
        return out[:kept.shape.numel()].view(kept.shape).detach().requires_grad_(kept.requires_grad)


class Arena:
    """ZeRO-R's contiguous buffers for the kept slices (seed 004 lines 221-222: defragmentation): one buffer,
    sized from the slices a round kept, that every slice of later rounds is cut from in order, so the many
    same-lifetime slices of a step take one block of memory instead of one allocation each between the
    activations (DeepSpeed's ``contiguous_memory_optimization``). A round ends when every slice cut in it has
    been gathered back (``give_back``; one microbatch's backward, or a pipeline's last in flight); the next
    ``take`` starts again at offset 0, with the buffer grown first if the last round needed more. A slice that
    does not fit (the first round, or a bigger one) gets its own allocation, as without the arena."""

    ALIGN = 512  # bytes: each slice starts where the CUDA caching allocator would start a block

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.offset = self.needed = self.live = 0
        self.fresh = False  # the buffer was just (re)allocated: its first slice counts the allocation

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor | None:
        """A slice of ``numel`` ``dtype`` elements cut from the buffer, or None where it does not fit."""
        if self.live == 0:
            self._new_round(device, pin)
        nbytes = -(-numel * dtype.itemsize // self.ALIGN) * self.ALIGN
        start, self.offset = self.offset, self.offset + nbytes
        self.needed, self.live = max(self.needed, self.offset), self.live + 1
        if self.buffer is None or self.offset > self.buffer.numel():
            return None
        return self.buffer[start:start + numel * dtype.itemsize].view(dtype)

    def give_back(self) -> None:
        """One slice of the round gathered back: the round ends with its last."""
        self.live = max(0, self.live - 1)

    def _new_round(self, device: torch.device, pin: bool) -> None:
        if self.needed and (self.buffer is None or self.buffer.numel() < self.needed):
            self.buffer = torch.empty(self.needed, dtype=torch.uint8, device=device, pin_memory=pin)
            self.fresh = True
        self.offset = 0
