"""Activation recompute policies, applied to a model's blocks from outside.

``full`` keeps only each block's input and recomputes the block in backward;
``selective`` recomputes just the attention core (softmax(QK^T)V), the
activations that grow with sequence length but cost little to recompute —
Megatron's selective recompute. What each policy wraps is the family's
declaration (``ModelFamily.recompute_targets``, a submodule of every block the
family's ``blocks`` hook lists), so a new family needs no change here.
PyTorch's composable ``checkpoint`` is used because it hooks the module in
place: parameter names (and so checkpoints) stay the same whatever the policy. Under ``train.compile`` its
hooks (a generator context entered in a pre-hook) do not trace, so there the module's ``forward`` calls
``torch.utils.checkpoint`` instead (``recompute_in_forward``), also in place.

``memory.recompute_every: k`` applies the policy to every k-th block only (global
layer index divisible by k, so every layout recomputes the same blocks): a
memory/compute dial between recomputing all blocks and none.
"""

from __future__ import annotations

import types

from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import checkpoint as checkpoint_call

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


def apply_recompute(stage: nn.Module, policy: str, family: ModelFamily, every: int = 1,
                    compiled: bool = False) -> None:
    """Recompute ``policy``'s modules in backward: by the composable ``checkpoint``'s hooks, or with
    ``compiled`` (the blocks will be compiled, ``workers.parallel.compile``) from inside their ``forward``."""
    for module in checkpointed_modules(stage, policy, family, every):
        if compiled:
            recompute_in_forward(module)
        else:
            checkpoint(module)


def recompute_in_forward(module: nn.Module) -> None:
    """Make ``module``'s own ``forward`` run under ``torch.utils.checkpoint`` (non-reentrant, the same
    mechanism as the composable ``checkpoint``), which Dynamo traces as its activation-checkpoint operator:
    AOTAutograd's partitioner then recomputes the region in the backward graph. A bound method on the
    instance, so a ``deepcopy`` of the module is bound to the copy; hooks (FSDP2's gathers) stay outside it."""
    module.forward = types.MethodType(_checkpointed_forward, module)


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    return checkpoint_call(type(self).forward, self, *args, use_reentrant=False, **kwargs)
