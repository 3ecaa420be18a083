"""Data parallelism and ZeRO stages, all from PyTorch.

| zero | wrapper | what is sharded over dp |
|---|---|---|
| 0 | ``replicate`` (FSDP2's DDP, which accepts DTensor/TP parameters) | nothing |
| 1 | DDP + ZeroRedundancyOptimizer (plain tensors only, so tp must be 1) | optimizer state |
| 2 | FSDP2, params kept unsharded between forward and backward | gradients + optimizer state |
| 3 | FSDP2, params resharded after forward | parameters + gradients + optimizer state |
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_data_parallel(stage: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh, zero: int,
                        experts: list[nn.Module] = (), edp_mesh: DeviceMesh | None = None) -> nn.Module:
    """Return ``stage`` wrapped for data parallelism over ``dp_mesh`` (FSDP2 works in place).

    ``blocks`` (the family's ``blocks`` hook) are FSDP2's units under ZeRO-2/3: each block's parameters are
    gathered just before it runs, so only one block is whole at a time. ``experts`` (expert parallelism's
    sharded ``Experts``) get a wrapper of their own over ``edp_mesh`` first, the ranks holding the same experts;
    the enclosing wrappers then leave their parameters alone (``workers.parallel.expert_parallel``).
    """
    if zero >= 2:
        reshard = zero == 3
        for unit in experts:
            fully_shard(unit, mesh=edp_mesh, reshard_after_forward=reshard)
            register_fsdp_forward_method(unit, "grouped")  # the dispatcher calls grouped, never forward
        for block in blocks:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
        fully_shard(stage, mesh=dp_mesh, reshard_after_forward=reshard)
        return stage
    if dp_mesh.size() == 1:
        return stage
    if zero == 0:
        for unit in experts:
            replicate(unit, mesh=edp_mesh)
            register_fsdp_forward_method(unit, "grouped")
        return replicate(stage, mesh=dp_mesh)
    return DDP(stage, process_group=dp_mesh.get_group())


def unwrap(module: nn.Module) -> nn.Module:
    """The model under a DDP wrapper, so parameter names match every other layout."""
    return module.module if isinstance(module, DDP) else module
