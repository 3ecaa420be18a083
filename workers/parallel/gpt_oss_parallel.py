"""gpt-oss's tensor-parallel plan: Llama's (q/k/v column-parallel with their biases, o row-parallel, its bias added
once after the reduction; the MoE feed-forward replicated, ``gpt_parallel.moe_style``), and the attention sinks
sharded with their heads (``ShardedHeads``), so each rank's core gets the sink logits of its own query heads."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from workers.model.gpt_oss import GptOss
from workers.parallel import llama_parallel
from workers.parallel.tensor_parallel import apply_plan


class ShardedHeads(ParallelStyle):
    """A module's per-head parameters (first dim: the query heads) as DTensors sharded on dim 0, as the column-
    parallel q projection deals heads: rank r of tp gets heads r*n/tp .. (r+1)*n/tp. The module reads its local
    shard (``HeadSinks.local``), so the gradient stays a sharded DTensor like the projections'."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        return distribute_module(module, device_mesh, shard)


def apply_tensor_parallel(stage: GptOss, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard ``stage`` over ``tp_mesh`` in place: each block's sinks by head, then Llama's plan."""
    for block in stage.layers.values():
        apply_plan(block.attention, tp_mesh, {"sinks": ShardedHeads()})
    llama_parallel.apply_tensor_parallel(stage, tp_mesh, sequence_parallel)
