"""Activation recompute policies, applied to a model's blocks from outside.

``full`` keeps only each block's input and recomputes the block in backward;
``selective`` recomputes just the attention core (softmax(QK^T)V), the
activations that grow with sequence length but cost little to recompute —
Megatron's selective recompute. What each policy wraps is the family's
declaration (``ModelFamily.recompute_targets``, a submodule of every block the
family's ``blocks`` hook lists), so a new family needs no change here.
PyTorch's composable ``checkpoint`` is used because it hooks the module in
place: parameter names (and so checkpoints) stay the same whatever the policy.

``memory.recompute_every: k`` applies the policy to every k-th block only (global
layer index divisible by k, so every layout recomputes the same blocks): a
memory/compute dial between recomputing all blocks and none.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint

from workers.model.registry import ModelFamily


def block_index(stage: nn.Module, block: nn.Module) -> int:
    """A block's layer index in the unsplit model: the last number in its name (stages keep global names)."""
    name = next(n for n, m in stage.named_modules() if m is block)
    return next(int(part) for part in reversed(name.split(".")) if part.isdigit())


def checkpointed_modules(stage: nn.Module, policy: str, family: ModelFamily, every: int = 1) -> list[nn.Module]:
    """The modules ``policy`` wraps in ``checkpoint``, in every ``every``-th block (the memory probe watches
    their inputs)."""
    if policy == "none":
        return []
    try:
        target = family.recompute_targets[policy]
    except KeyError:
        raise ValueError(f"memory.recompute {policy!r} is not declared by model.arch {family.arch!r} (it declares "
                         f"{sorted(family.recompute_targets)}); pick one of those or 'none', or add it to the "
                         "family's recompute_targets") from None
    blocks = family.hook("blocks")(stage)
    return [block.get_submodule(target) for block in blocks if block_index(stage, block) % every == 0]


def apply_recompute(stage: nn.Module, policy: str, family: ModelFamily, every: int = 1) -> None:
    for module in checkpointed_modules(stage, policy, family, every):
        checkpoint(module)
