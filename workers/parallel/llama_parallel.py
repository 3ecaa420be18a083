"""The Llama family's tensor-parallel plan (its stage cut and blocks are the GPT's: same layout of layers and ends).

Megatron's split as for the GPT, with grouped K/V: wq, wk, wv and the SwiGLU's w1 (gate) and w3 (up) are
column-parallel, wo and w2 (down) row-parallel. Column-splitting wk/wv hands each rank n_kv_heads / tp whole
K/V heads next to its n_heads / tp query heads, so the query-to-K/V grouping stays local; that needs tp to
divide n_kv_heads, which the job spec checks (``orchestrator.spec.checks.tensor.check_tensor_split``) rather
than replicating K/V heads.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, SequenceParallel

from workers.model.llama import Llama
from workers.parallel import gpt_parallel
from workers.parallel.tensor_parallel import apply_plan


def apply_tensor_parallel(stage: Llama, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard ``stage`` over ``tp_mesh`` in place: ends (the GPT's plan), then every block; re-tie a tied head."""
    shard_ends(stage, tp_mesh, sequence_parallel)
    for block in stage.layers.values():
        apply_plan(block, tp_mesh, block_plan(sequence_parallel, gpt_parallel.is_moe(block), stage.cfg.qk_norm))


def shard_ends(stage: Llama, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """The embeddings, final norm and head this stage owns, by the GPT's plan; a tied head tied again."""
    apply_plan(stage, tp_mesh, gpt_parallel.ends_plan(stage, sequence_parallel))
    if stage.cfg.tie_embeddings and stage.tok_embeddings is not None and stage.output is not None:
        # both shard the [vocab, d_model] weight by rows (Shard(0)), so one DTensor serves both again
        stage.output.weight = stage.tok_embeddings.weight


def block_plan(sequence_parallel: bool, moe: bool = False, qk_norm: bool = False) -> dict[str, ParallelStyle]:
    """The GPT's block plan plus the SwiGLU's up projection w3, column-parallel like the gate w1 (an MoE
    feed-forward is replicated whole, as the GPT's). Qwen2's q/k/v biases shard with their columns
    (``ColwiseParallel`` splits a bias as its rows). Qwen3's q/k norms (``qk_norm``) are per head, so their
    weight is replicated; each rank norms only its own heads, so the style marks the input as sharded on the
    head dim (``SequenceParallel(sequence_dim=2)``), whose replicated weight's gradient is then summed over tp."""
    plan = gpt_parallel.block_plan(sequence_parallel, moe)
    if qk_norm:
        for name in ("q_norm", "k_norm"):
            plan[f"attention.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan if moe else {**plan, "feed_forward.w3": ColwiseParallel()}
