"""``precision.float8``: the blocks' linear layers compute their matmuls in float8 through torchao's float8 training.

torchao swaps each chosen ``nn.Linear`` for its ``Float8Linear``: the weight stays a float32 (or FSDP2-sharded)
parameter of the same name, and each forward and backward casts the matmul's inputs to float8 with dynamic scales
(``tensorwise``: one scale per tensor, the fastest kernel; ``rowwise``: one per row, closer to bf16's numbers).
Only the blocks' projections are swapped: the output head and embeddings keep bf16 (the vocabulary's logits are
where float8's range hurts most, as torchtitan leaves them), and so do MoE routers (top-k choices flip on tiny
score changes) and the 3-D expert stacks (not ``nn.Linear``). A layer whose dimensions are not multiples of 16
stays as it is: the float8 GEMMs need them.

Where FP8 matmuls cannot run (a CPU, or the tests), torchao's emulation computes the same casts and scales and
multiplies in the input's dtype, so a CPU run has float8's rounding without its kernels. Under FSDP2 the
tensorwise recipe all-gathers the weights already cast to float8 (half the bytes of bf16); rowwise gathers
them in the compute dtype. Parameters, gradients, optimizer state and so checkpoints stay plain tensors of the
parameter dtype (torchao's all-gather wrapper flattens to its plain weight in a state dict), so a float8
checkpoint reshards, resumes without float8 and exports like any other (tests/unit/test_float8.py reads one).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

# float8 e4m3 GEMMs need compute capability 8.9 (Ada, Hopper) or newer
MIN_CAPABILITY = (8, 9)
# module names (the last part of their qualified name) float8 never swaps inside a block
KEPT = frozenset({"router", "gate", "output"})


def check_float8_device(recipe: str, device: torch.device) -> None:
    """Refuse ``precision.float8`` on a GPU without FP8 matmuls, before the model is built."""
    if recipe == "none" or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"precision.float8 {recipe!r}: {name} (compute capability {capability[0]}.{capability[1]}) "
                         "has no FP8 matmuls (they need 8.9: Ada, Hopper or newer); set precision.float8: none")


def float8_config(recipe: str, device: torch.device, fsdp: bool):
    """torchao's ``Float8LinearConfig`` for ``recipe``: emulated off CUDA, float8 all-gather where the recipe
    allows it (tensorwise under FSDP2)."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=device.type != "cuda",
                               enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise")


def swaps(module: nn.Module, name: str) -> bool:
    """Whether float8 swaps ``module`` (at ``name`` within a block): a linear layer, not a router's or the head's,
    both of whose dimensions are multiples of 16."""
    if not isinstance(module, nn.Linear) or set(name.split(".")) & KEPT:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(blocks: list[nn.Module], recipe: str, device: torch.device, fsdp: bool) -> int:
    """Swap the chosen linear layers of ``blocks`` for torchao's ``Float8Linear`` in place (before TP and FSDP2
    wrap them, as torchao requires); the number swapped."""
    if recipe == "none":
        return 0
    from torchao.float8 import convert_to_float8_training

    config = float8_config(recipe, device, fsdp)
    swapped = []

    def chosen(module: nn.Module, name: str) -> bool:
        keep = swaps(module, name)
        swapped.extend([name] if keep else [])
        return keep

    for block in blocks:
        convert_to_float8_training(block, module_filter_fn=chosen, config=config)
    return len(swapped)
