"""``parallel.fsdp_prefetch``: FSDP2 all-gathers issued ``k`` blocks ahead, in forward and in backward.

FSDP2 on its own prefetches one block in backward (the next in reverse forward order) and gathers each block
in forward when it starts. With ``k`` > 0 each block, once gathered, also starts the all-gathers of the next
``k`` blocks in forward and of the ``k`` before it in backward (``set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch``), so the communication of more blocks overlaps one block's compute, at
the cost of up to ``k`` more whole blocks held at once. Only the order of collectives changes, not the values;
whether it pays is a GPU measurement (issue 19), on CPU with gloo it is checked for parity only.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule


def set_prefetch(blocks: list[nn.Module], depth: int) -> None:
    """Have each of ``blocks`` (FSDP2 units, in forward order) prefetch the next ``depth`` blocks in forward
    and the ``depth`` before it, nearest first, in backward; ``depth`` 0 leaves FSDP2's implicit order."""
    if depth == 0:
        return
    units: list[FSDPModule] = list(blocks)  # type: ignore[arg-type]
    for i, block in enumerate(units):
        block.set_modules_to_forward_prefetch(units[i + 1:i + 1 + depth])
        block.set_modules_to_backward_prefetch(units[max(0, i - depth):i][::-1])
