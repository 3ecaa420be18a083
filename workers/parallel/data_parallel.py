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
from torch.distributed.tensor import DTensor

from workers.parallel.fsdp_quantized_gather import wrap_for_gather


def apply_data_parallel(stage: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh, zero: int,
                        experts: list[nn.Module] = (), edp_mesh: DeviceMesh | None = None,
                        mixed: MixedPrecisionPolicy | None = None, bucket_mb: float | None = None,
                        gather_dtype: str = "fp32") -> nn.Module:
    """Return ``stage`` wrapped for data parallelism over ``dp_mesh`` (FSDP2 works in place).

    ``blocks`` (the family's ``blocks`` hook) are FSDP2's units under ZeRO-2/3: each block's parameters are
    gathered just before it runs, so only one block is whole at a time. ``experts`` (expert parallelism's
    sharded ``Experts``) get a wrapper of their own over ``edp_mesh`` first, the ranks holding the same experts;
    the enclosing wrappers then leave their parameters alone (``workers.parallel.expert_parallel``). ZeRO-0 and
    ZeRO-1 wrap nothing: the builder's gradient buckets (``grad_buckets.py``) or the ``DistributedOptimizer``
    reduce the gradients. ``mixed`` is FSDP2's mixed-precision policy for every unit (``bf16_policy``), None for
    none. ``bucket_mb`` (``parallel.fsdp_bucket_mb``) groups consecutive blocks into units of at most that many
    MiB (``fsdp_units``). ``gather_dtype`` (``parallel.param_gather_dtype``) is what FSDP2's all-gathers move
    (``fsdp_quantized_gather``): the fp32 shards stay what the optimizer steps.
    """
    if zero >= 2:
        wrap_for_gather(stage, gather_dtype)
        kw = {"reshard_after_forward": zero == 3, "mp_policy": mixed or MixedPrecisionPolicy()}
        for unit in experts:
            fully_shard(unit, mesh=edp_mesh, **kw)
            register_fsdp_forward_method(unit, "grouped")  # the dispatcher calls grouped, never forward
        for unit in fsdp_units(blocks, bucket_mb, kw["mp_policy"].param_dtype):
            fully_shard(unit if len(unit) > 1 else unit[0], mesh=dp_mesh, **kw)
        fully_shard(stage, mesh=dp_mesh, **kw)
        if getattr(stage, "loss_chunks", 1) > 1:  # the head runs in the loss (train.loss_chunks), gathered there
            register_fsdp_forward_method(stage, "head_loss")
        if getattr(stage, "mtp", None) is not None:  # model.mtp_layers: the MTP loss runs after the forward
            register_fsdp_forward_method(stage, "mtp_loss")
        return stage
    return stage  # zero 0: the builder adds gradient buckets (grad_buckets.py); zero 1: DistributedOptimizer


def fsdp_units(blocks: list[nn.Module], bucket_mb: float | None,
               gather_dtype: torch.dtype | None = None) -> list[list[nn.Module]]:
    """ZeRO-R's constant-size buffers (seed 004 lines 219-221) as FSDP2 units: consecutive ``blocks`` grouped
    while their parameters, as each all-gather moves them (this rank's tp shard, in ``gather_dtype`` where the
    mixed-precision policy casts), stay within ``bucket_mb`` MiB. FSDP2 gathers and reduce-scatters a unit's
    parameters as one flat buffer (a list given to ``fully_shard`` is one unit), so the buffers are of one known
    size, bounded by the bucket, as DeepSpeed's fixed buffers are; a block above the bucket is a unit alone.
    ``None``: one unit per block, as before."""
    if bucket_mb is None:
        return [[block] for block in blocks]
    limit, units, size = bucket_mb * 2**20, [], 0.0
    for block in blocks:
        nbytes = sum(_local(p).numel() * (gather_dtype or p.dtype).itemsize for p in block.parameters())
        if units and size + nbytes <= limit:
            units[-1].append(block)
            size += nbytes
        else:
            units.append([block])
            size = nbytes
    return units


def _local(p: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel DTensor's local shard (what FSDP2 shards again over dp), else ``p``."""
    return p.to_local() if isinstance(p, DTensor) else p


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
