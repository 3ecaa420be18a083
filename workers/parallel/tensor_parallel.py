"""Tensor (and sequence) parallelism through DTensor plans: the mechanism, not any model's plan.

A family's ``tensor_parallel`` hook (``workers.model.registry``) decides which
submodule gets which ``ParallelStyle``; this module applies such a plan, with
LoRA/QLoRA layers split into their base and adapter entries
(``workers.parallel.lora_tp``), so the adapters follow whatever style the
family gave their base layer. Plans should leave activations as local tensors,
so pipeline stages exchange plain tensors.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from workers.parallel.lora_tp import adapt_plan


def activation_layout(sequence_parallel: bool) -> Placement:
    """How activations travel between TP regions: split along the sequence under SP, else whole on every rank."""
    return Shard(1) if sequence_parallel else Replicate()


def apply_plan(module: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> None:
    """Place ``module``'s submodules over ``tp_mesh`` as ``plan`` says, in place (LoRA layers adapted)."""
    parallelize_module(module, tp_mesh, adapt_plan(module, plan))
