"""ZeRO-R's partitioned activation checkpoints (Pa, seed 004 lines 97-101 and 215-222), optionally in host memory.

Under full (or ``sqrt``) recompute a block keeps only its input for backward. Without sequence parallelism that
input is the same on every tensor-parallel rank (Megatron's tp replicates the residual stream), so tp ranks keep tp
copies of it. ``memory.partition_activations`` keeps 1/tp of it on each rank instead (a flat slice, the last one
zero-padded) and all-gathers the whole input over tp when backward recomputes the block; ``host`` also puts the
slice in host memory (pinned on a GPU) and brings it back first (Pa+cpu). The gathered input is a bit-exact copy
of the forward's, so gradients are unchanged; the price is one all-gather of the input per recomputed block.

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

    def __init__(self, group: dist.ProcessGroup | None, place: str):
        if place not in PLACES[1:]:
            raise ValueError(f"memory.partition_activations {place!r}: InputSlices keeps slices on 'device' or "
                             "'host'; 'none' keeps whole inputs (no InputSlices)")
        self.group, self.place = group, place
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.listeners: list[Callable[[torch.Tensor, str], None]] = []

    def keep(self, x: torch.Tensor) -> Kept:
        """This rank's slice of ``x`` (a copy, so ``x`` itself can be freed), in host memory for ``host``."""
        flat = x.detach().reshape(-1)
        per = -(-flat.numel() // self.size)
        mine = flat[self.rank * per:(self.rank + 1) * per]
        if self.place == "host":
            part = torch.zeros(per, dtype=x.dtype, device="cpu", pin_memory=x.is_cuda)
            part[:mine.numel()].copy_(mine, non_blocking=True)
        else:
            part = torch.zeros(per, dtype=x.dtype, device=x.device)
            part[:mine.numel()].copy_(mine)
        for listener in self.listeners:
            listener(part, self.place)
        return Kept(part, x.shape, x.requires_grad)

    def whole(self, kept: Kept, device: torch.device) -> torch.Tensor:
        """The block input again, gathered from every tp rank's slice (a leaf needing a gradient where the
        forward's input did, so the recompute saves what the forward saved)."""
        part = kept.part.to(device, non_blocking=True)
        if self.size > 1:
            out = torch.empty(part.numel() * self.size, dtype=part.dtype, device=device)
            dist.all_gather_into_tensor(out, part, group=self.group)
        else:
            out = part
        return out[:kept.shape.numel()].view(kept.shape).detach().requires_grad_(kept.requires_grad)
