"""Activation recompute policies, applied to a model's blocks from outside.

``full`` keeps only each block's input and recomputes the block in backward;
``selective`` recomputes just the attention core (softmax(QK^T)V), the
activations that grow with sequence length but cost little to recompute —
Megatron's selective recompute. PyTorch's composable ``checkpoint`` is used
because it hooks the module in place: parameter names (and so checkpoints)
stay the same whatever the policy.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint


def checkpointed_modules(stage: nn.Module, policy: str) -> list[nn.Module]:
    """The modules ``policy`` wraps in ``checkpoint`` (the memory probe watches their inputs)."""
    if policy == "none":
        return []
    return [block if policy == "full" else block.attention.core for block in stage.layers.values()]


def apply_recompute(stage: nn.Module, policy: str) -> None:
    for module in checkpointed_modules(stage, policy):
        checkpoint(module)
