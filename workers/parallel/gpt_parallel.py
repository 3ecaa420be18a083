"""The GPT family's builder hooks: how a GPT is cut into pipeline stages, sharded over TP, and where its blocks are.

Everything here is GPT knowledge (attribute names, which Linear is column- or
row-parallel); the mechanisms (applying a DTensor plan, checkpointing a module,
which layers a stage owns) stay generic in ``workers.parallel``, so a second
family writes its own module like this one instead of editing the builder.
``workers.model.gpt`` names these functions as ``"module:function"`` hooks,
imported on first use, so importing the model does not import the parallel
wrappers.

Tensor parallelism is Megatron's: attention and MLP get column-parallel inputs
and a row-parallel output, so each block costs one all-reduce forward and one
backward (or, with sequence parallelism, a reduce-scatter/all-gather pair that
also shards the norms' activations along the sequence). An MoE feed-forward is
replicated over the tensor-parallel ranks instead (``moe_style``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from workers.model.gpt import GPT
from workers.model.moe import MoELayer
from workers.parallel.layout import layers_of_stage
from workers.parallel.tensor_parallel import activation_layout, apply_plan


def blocks(model: GPT) -> list[nn.Module]:
    """The transformer blocks this model (or stage) holds, in order: what recompute and FSDP2 wrap."""
    return list(model.layers.values())


def cut_stage(model: GPT, stage: int, n_stages: int, split: Sequence[int] | None = None) -> GPT:
    """A copy of ``model`` holding only ``stage``'s layers (plus embeddings first, head last); ``split``: layer
    counts per stage (``parallel.pp_split`` resolved), None for an even split."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in layers_of_stage(stage, n_stages, model.cfg.n_layers, split)}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
        part.pos_embeddings = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
    return part


def apply_tensor_parallel(stage: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard ``stage`` (a whole model or one pipeline stage) over ``tp_mesh`` in place: ends first, then blocks."""
    apply_plan(stage, tp_mesh, ends_plan(stage, sequence_parallel))
    for block in stage.layers.values():
        apply_plan(block, tp_mesh, block_plan(sequence_parallel, is_moe(block)))  # fresh styles for every block


def ends_plan(stage: GPT, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Embeddings, final norm and head, for the ones this stage owns; activations leave as local tensors."""
    act = activation_layout(sequence_parallel)
    plan: dict[str, ParallelStyle] = {}
    if stage.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if stage.pos_embeddings is not None:
        # positions are [1 or batch, seq] (``GPT.learned_positions``): its output sharded on dim 1 lines up with
        # Shard(1) tokens
        plan["pos_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sequence_parallel else Replicate()
        )
    if stage.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if stage.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=act, output_layouts=Replicate())
    return plan


def is_moe(block: nn.Module) -> bool:
    """Whether ``block``'s feed-forward is a mixture of experts (``workers.model.moe.MoELayer``)."""
    return isinstance(block.feed_forward, MoELayer)


def block_plan(sequence_parallel: bool, moe: bool = False) -> dict[str, ParallelStyle]:
    """One block's plan: q/k/v and w1 column-parallel, wo and w2 row-parallel back to the activation layout;
    an MoE feed-forward (``moe``) replicated (``moe_style``)."""
    act = activation_layout(sequence_parallel)
    plan: dict[str, ParallelStyle] = {
        "attention": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=act),
    }
    if moe:
        plan["feed_forward"] = moe_style(sequence_parallel)
    else:
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),))
        plan["feed_forward.w1"] = ColwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel(output_layouts=act)
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    return plan


def moe_style(sequence_parallel: bool) -> ParallelStyle:
    """An MoE feed-forward under TP: every tensor-parallel rank runs the whole layer (router, dispatch, its
    experts) on the whole microbatch, as plain tensors; its parameters stay plain tensors, replicated.

    Why replicated rather than each expert split over tp on its hidden dim (a column/row-parallel MLP per
    expert): routing needs every token's full hidden vector anyway, capacity and the auxiliary losses are per
    routing group (a sequence), and expert parallelism already splits the experts' memory over ``ep``; a
    hidden-dim split would add an all-reduce per MoE layer and a second sharding of the stacked expert weights
    (init, checkpoints, the ep slicing) for memory that ``ep`` can save instead.

    Under sequence parallelism the input (sharded along the sequence) is all-gathered to Replicate and the
    output cut back to this rank's sequence shard; the backward of the gather is a local cut (every rank
    computed the same full gradient) and that of the cut an all-gather. The replicated parameters therefore see
    the same inputs and output gradients on every tp rank and get bitwise the same gradients, as the
    replicated norm weights of TP without sequence parallelism do.
    """
    act = activation_layout(sequence_parallel)
    return PrepareModuleInputOutput(input_layouts=(act,), desired_input_layouts=(Replicate(),),
                                    use_local_input=True, output_layouts=(Replicate(),),
                                    desired_output_layouts=(act,), use_local_output=True)
