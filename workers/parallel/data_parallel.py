"""Data parallelism and ZeRO stages, all from PyTorch.

| zero | wrapper | what is sharded over dp |
|---|---|---|
| 0 | none here: ``workers.parallel.grad_buckets`` averages gradients in buckets during backward | nothing |
| 1 | none: ``DistributedOptimizer`` (``distributed_optimizer.py``) reduce-scatters after backward | optimizer state |
| 2 | FSDP2, params kept unsharded between forward and backward | gradients + optimizer state |
| 3 | FSDP2, params resharded after forward | parameters + gradients + optimizer state |
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method


def apply_data_parallel(stage: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh, zero: int,
                        experts: list[nn.Module] = (), edp_mesh: DeviceMesh | None = None,
                        mixed: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Return ``stage`` wrapped for data parallelism over ``dp_mesh`` (FSDP2 works in place).

    ``blocks`` (the family's ``blocks`` hook) are FSDP2's units under ZeRO-2/3: each block's parameters are
    gathered just before it runs, so only one block is whole at a time. ``experts`` (expert parallelism's
    sharded ``Experts``) get a wrapper of their own over ``edp_mesh`` first, the ranks holding the same experts;
    the enclosing wrappers then leave their parameters alone (``workers.parallel.expert_parallel``). ZeRO-0 and
    ZeRO-1 wrap nothing: the builder's gradient buckets (``grad_buckets.py``) or the ``DistributedOptimizer``
    reduce the gradients. ``mixed`` is FSDP2's mixed-precision policy for every unit (``bf16_policy``), None for
    none.
    """
    if zero >= 2:
        kw = {"reshard_after_forward": zero == 3, "mp_policy": mixed or MixedPrecisionPolicy()}
        for unit in experts:
            fully_shard(unit, mesh=edp_mesh, **kw)
            register_fsdp_forward_method(unit, "grouped")  # the dispatcher calls grouped, never forward
        for block in blocks:
            fully_shard(block, mesh=dp_mesh, **kw)
        fully_shard(stage, mesh=dp_mesh, **kw)
        if getattr(stage, "loss_chunks", 1) > 1:  # the head runs in the loss (train.loss_chunks), gathered there
            register_fsdp_forward_method(stage, "head_loss")
        return stage
    return stage  # zero 0: the builder adds gradient buckets (grad_buckets.py); zero 1: DistributedOptimizer


def reduce_policy(grad_reduce_dtype: str) -> MixedPrecisionPolicy | None:
    """fp32 parameters and compute, gradients reduce-scattered in bf16 (``parallel.grad_reduce_dtype``: half the
    bytes) and cast back to the fp32 shards; None for fp32 (FSDP2's default)."""
    if grad_reduce_dtype == "fp32":
        return None
    return MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)


def bf16_policy(reduce_dtype: str) -> MixedPrecisionPolicy:
    """bf16 parameters (so bf16 compute and all-gathers) over the fp32 shards the optimizer steps; gradients
    reduced, and accumulated across microbatches, in ``reduce_dtype`` (``precision.reduce_dtype``)."""
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                reduce_dtype=torch.float32 if reduce_dtype == "fp32" else torch.bfloat16)
