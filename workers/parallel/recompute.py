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

``sqrt`` is Chen et al. 2016's segment checkpointing (seed 000 lines 405-415, 001 lines 221-225): the ℓ blocks
cut into segments of k consecutive blocks (global index // k, so every layout cuts the same segments; the spec
sends k = round(√ℓ) as ``recompute_every``), only each segment's input stored, and the whole segment recomputed
in backward when its first saved tensor is needed: O(ℓ/k) blocks' activations alive in backward plus O(k)
stored inputs, least at k = √ℓ. No module holds a segment, so it is checkpointed by hooks, as the composable
``checkpoint`` does one module: the non-reentrant checkpoint's generator is entered before the segment's first
block and left after its last, and its recompute function runs the segment's blocks in order.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator
from torch.utils.checkpoint import checkpoint as checkpoint_call

from workers.model.registry import ModelFamily
from workers.parallel.partitioned_activations import InputSlices, Kept


def block_index(stage: nn.Module, block: nn.Module) -> int:
    """A block's layer index in the unsplit model: the last number in its name (stages keep global names)."""
    name = next(n for n, m in stage.named_modules() if m is block)
    return next(int(part) for part in reversed(name.split(".")) if part.isdigit())


def checkpointed_modules(stage: nn.Module, policy: str, family: ModelFamily, every: int = 1) -> list[nn.Module]:
    """The modules ``policy`` wraps in ``checkpoint``, in every ``every``-th block (the memory probe watches
    their inputs)."""
    if policy == "none":
        return []
    if policy == "sqrt":  # a segment stores its first block's input
        return [blocks[0] for blocks in segments(stage, family, every)]
    try:
        target = family.recompute_targets[policy]
    except KeyError:
        raise ValueError(f"memory.recompute {policy!r} is not declared by model.arch {family.arch!r} (it declares "
                         f"{sorted(family.recompute_targets)}); pick one of those or 'none', or add it to the "
                         "family's recompute_targets") from None
    blocks = family.hook("blocks")(stage)
    return [block.get_submodule(target) for block in blocks if block_index(stage, block) % every == 0]


def apply_recompute(stage: nn.Module, policy: str, family: ModelFamily, every: int = 1,
                    compiled: bool = False, slices: InputSlices | None = None) -> None:
    """Recompute ``policy``'s modules in backward: by the composable ``checkpoint``'s hooks, or with
    ``compiled`` (the blocks will be compiled, ``workers.parallel.compile``) from inside their ``forward``;
    ``sqrt``: segments of ``every`` blocks, each recomputed whole (``checkpoint_segment``). With ``slices``
    (ZeRO-R's Pa, ``full`` or ``sqrt``), each stored input is kept as ``slices`` keeps it, so through
    ``checkpoint_segment`` (a one-block segment under ``full``), whose stored arguments this code chooses."""
    if policy == "sqrt":
        for blocks in segments(stage, family, every):
            checkpoint_segment(blocks, slices)
        return
    if slices is not None:
        segments(stage, family, every)  # refuses a family without whole blocks, as sqrt does
        for module in checkpointed_modules(stage, policy, family, every):
            checkpoint_segment([module], slices)
        return
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


def segments(stage: nn.Module, family: ModelFamily, length: int) -> list[list[nn.Module]]:
    """The stage's blocks in segments of ``length`` by global layer index (a pipeline cut through a segment
    leaves each stage its own part of it). Only a family whose ``full`` policy wraps whole blocks has blocks that
    pass one tensor on, which a segment's recompute needs."""
    if family.recompute_targets.get("full") != "":
        raise ValueError(f"memory.recompute 'sqrt' needs whole blocks passing one tensor on; model.arch "
                         f"{family.arch!r} does not declare them; use memory.recompute: full")
    out: dict[int, list[nn.Module]] = {}
    for block in family.hook("blocks")(stage):
        out.setdefault(block_index(stage, block) // length, []).append(block)
    return list(out.values())


def checkpoint_segment(blocks: list[nn.Module], slices: InputSlices | None = None) -> None:
    """Keep only the input of ``blocks`` (consecutive, each feeding the next) for backward and recompute them all
    there: a checkpoint entered by a pre-hook on the first block and left by a hook after the last, whose
    recompute calls the blocks in order with those hooks off (so FSDP2's own hooks gather the weights again).
    With ``slices``, the checkpoint stores this rank's slice of the input (and an empty tensor on the input's
    device, from which it stashes that device's RNG state) and its recompute gathers the input whole first."""
    state = {"on": True, "gen": None}

    def run(x: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            x = block(x)
        return x

    def run_kept(kept: Kept, like: torch.Tensor) -> torch.Tensor:
        return run(slices.whole(kept, like.device))

    @contextlib.contextmanager
    def recomputing():
        state["on"] = False
        try:
            yield
        finally:
            state["on"] = True

    def enter(module: nn.Module, args: tuple) -> None:
        if state["on"]:
            kept = slices is not None and torch.is_grad_enabled()  # no backward, nothing to keep (evaluation)
            fn, stored = (run_kept, (slices.keep(args[0]), args[0].new_empty(0))) if kept else (run, args)
            state["gen"] = _checkpoint_without_reentrant_generator(
                fn, True, lambda: (contextlib.nullcontext(), recomputing()), "default", False, True, *stored)
            next(state["gen"])

    def leave(module: nn.Module, args: tuple, output) -> None:
        gen, state["gen"] = state["gen"], None
        if state["on"] and gen is not None:
            with contextlib.suppress(StopIteration):
                next(gen)

    blocks[0].register_forward_pre_hook(enter)
    blocks[-1].register_forward_hook(leave, prepend=True, always_call=True)
