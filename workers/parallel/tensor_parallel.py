"""Megatron-style tensor (and sequence) parallelism through DTensor plans.

Attention and MLP get column-parallel inputs and a row-parallel output, so each
block costs one all-reduce forward and one backward (or, with sequence
parallelism, a reduce-scatter/all-gather pair that also shards the norms'
activations along the sequence). Activations leave every module as local
tensors, so pipeline stages exchange plain tensors.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from workers.model.gpt import GPT
from workers.parallel.lora_tp import adapt_plan


def apply_tensor_parallel(stage: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard ``stage`` (a whole model or one pipeline stage) over ``tp_mesh`` in place."""
    act = Shard(1) if sequence_parallel else Replicate()
    top: dict = {}
    if stage.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if stage.pos_embeddings is not None:
        # positions index rows [0, seq): sharding its output on dim 0 lines up with Shard(1) tokens
        top["pos_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(0) if sequence_parallel else Replicate()
        )
    if stage.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if stage.output is not None:
        top["output"] = ColwiseParallel(input_layouts=act, output_layouts=Replicate())
    parallelize_module(stage, tp_mesh, adapt_plan(stage, top))

    for block in stage.layers.values():
        plan = {
            "attention": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=act),
            "feed_forward": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=act),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, adapt_plan(block, plan))
