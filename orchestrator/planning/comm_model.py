"""Predicted communication: bytes each rank sends per training step, per mesh dimension, as pure arithmetic.

Why our own: NCCL and gloo count nothing, and the planner needs the figure before anything runs. Each
collective is counted as the bytes one rank sends under the bandwidth-optimal ring (Patarasuk & Yuan;
the ZeRO paper's accounting, seed articles 003/004), for a payload of Φ bytes over N ranks:

- all-reduce: 2(N-1)/N · Φ (a reduce-scatter then an all-gather);
- reduce-scatter and all-gather: (N-1)/N · Φ each (Φ is the whole, unsharded payload);
- all-to-all: (N-1)/N · Φ (Φ: what the rank holds before the exchange);
- point-to-point: Φ.

Per dimension (``step_bytes``):

- dp: ZeRO-0 all-reduces the gradients once a step (2Φ in the paper's units); ZeRO-1 (raymesh's
  distributed optimizer, Megatron's) reduce-scatters them and all-gathers the updated slices, the same
  2(N-1)/N · Φ; ZeRO-2 reduce-scatters the gradients once (after the last microbatch) and all-gathers the
  parameters for every microbatch's forward (FSDP2 reshards after backward; a pipeline keeps them after
  its first backward: once); ZeRO-3 all-gathers for forward and again for backward per microbatch (3Φ for
  one microbatch, the paper's figure), in a pipeline m + 1 times (each forward reshards, backward does not).
  Under FSDP2's bf16 policy the gathers move bf16 parameters and the reduction ``precision.reduce_dtype``.
- tp (Megatron): per block and microbatch two all-reduces of the b·s·h activations in forward and two
  in backward; with sequence parallelism each becomes a reduce-scatter plus an all-gather (the same bytes).
  The stage holding the embedding reduces its output into the sequence shards (forward) and gathers the
  gradient back (backward), the stage holding the head gathers its input and reduce-scatters the gradient:
  one all-reduce's bytes each (``sp_edges``). The vocabulary-parallel head all-gathers its logits in
  forward; the loss runs replicated, so backward only slices the gradient (no bytes). Under sequence
  parallelism the norms' weights are replicated while their gradients are partial sums over the sequence
  shards: the global-norm clip all-reduces them once a step (``norm_bytes``).
- pp: per microbatch a stage sends the b·s·h hidden state forward across its downstream edge and the
  gradient back across its upstream edge: one send per edge it has (``boundaries``), not two.
- cp (``workers/parallel/context_parallel.py``), per block and microbatch, by ``parallel.cp_impl`` (``cp_bytes``):
  ring: K and V blocks travel cp-1 hops in forward; in backward they travel cp-1 hops again while their
  float32 dK/dV accumulators travel cp-1 hops (from the block's first visitor, the last one home to its owner;
  the owner's own share never leaves it). all-gather: one
  all-gather of K/V in forward, one all-to-all of every block's float32 dK/dV in backward. Ulysses: all-to-alls
  of q, k, v (K/V heads repeated up to cp when fewer) and of the output in forward, the same in backward. The
  gradients are averaged over dp x cp (cp ranks hold replicated weights, each one's gradient its tokens' share),
  so the dp row's collectives span dp·cp ranks.
- ep: per MoE block and microbatch, dispatch and combine all-to-alls of the routed tokens (top_k copies of
  b·s·h), in forward and again in backward. The routed experts' own data-parallel collectives (their gradients
  and, under ZeRO, their parameters: ``expert_param_bytes``, the rank's 1/ep of them) run over the dp·cp/ep ranks
  holding the same experts (``workers.parallel.expert_parallel``), counted in the dp row.

Hybrid sharding (``parallel.dp_shard``, HSDP): ZeRO's collectives above run inside a shard group of
dp_shard·cp ranks (row ``dp_shard``), and the replicas of a shard all-reduce only its reduced gradient, Φ/(dp_shard·cp)
over dp/dp_shard ranks (row ``dp_replicate``, in place of ``dp``).

Checked against the bytes ``workers.diagnostics.comm_bytes`` counts on every parity layout
(tests/integration/test_comm_model.py, within 5%).
"""

from __future__ import annotations

from dataclasses import dataclass

DIMS = ("dp", "tp", "pp", "cp", "ep")


def all_reduce(payload: float, n: int) -> float:
    return 2 * (n - 1) / n * payload if n > 1 else 0.0


def reduce_scatter(payload: float, n: int) -> float:
    return (n - 1) / n * payload if n > 1 else 0.0


all_gather = reduce_scatter  # the same bytes, the other direction
all_to_all = reduce_scatter


def ps_vs_ring(payload: float, n: int, bandwidth: float) -> dict[str, tuple[float, float, float]]:
    """Seed 004's table (lines 126-144): per role, (bytes received, bytes sent, seconds) to average Φ = ``payload``
    bytes of gradients over ``n`` workers on links of ``bandwidth`` bytes/s each way (send and receive overlap, so
    a role's time is the larger of the two over B). A parameter server receives every worker's Φ and sends each
    the result: NΦ/B, growing with N; a ring's card moves (N-1)/N·Φ each way in the reduce-scatter and again in
    the all-gather: 2(N-1)/N·Φ/B, which the seed rounds to 2Φ/B, whatever N."""
    rs = reduce_scatter(payload, n)
    rows = {"ps server": (n * payload, n * payload), "ps worker": (payload, payload),
            "ring reduce-scatter": (rs, rs), "ring all-gather": (rs, rs), "ring all-reduce": (2 * rs, 2 * rs)}
    return {role: (got, sent, max(got, sent) / bandwidth) for role, (got, sent) in rows.items()}


@dataclass(frozen=True)
class CommShape:
    """What the formulas need, in plain numbers, for one rank of a layout.

    ``param_bytes``/``grad_bytes``: this rank's parameters as the data-parallel collectives see them
    (before ZeRO sharding: its pipeline stage and tensor-parallel share); ``hidden_bytes``: one
    microbatch's b·s·h at the compute width (what TP reduces); ``boundary_bytes``: one microbatch's
    hidden state as a pipeline stage sends it (raymesh: fp32, sequence-sharded under SP); ``kv_bytes``:
    one block's K and V for the rank's sequence chunk; ``logit_bytes``: one microbatch's logits
    (b·s·vocab at the compute width); ``blocks``: blocks on this rank; ``moe_blocks``: those with experts.
    """

    param_bytes: float
    grad_bytes: float
    hidden_bytes: float
    boundary_bytes: float
    kv_bytes: float = 0.0
    logit_bytes: float = 0.0
    blocks: int = 1
    moe_blocks: int = 0
    top_k: int = 1
    holds_head: bool = True
    boundaries: int = 0  # stage edges this rank has; it sends across each once per microbatch (see module doc)
    sp_edges: int = 0  # embedding output / head input on this rank: a sequence-parallel reduce and gather each
    norm_bytes: float = 0.0  # replicated norm weights whose gradients tp all-reduces once a step (SP)
    cp_impl: str = "ring"  # parallel.cp_impl: which exchange the cp row prices (``cp_bytes``)
    q_bytes: float = 0.0  # one block's queries for the rank's chunk (as its output): what Ulysses exchanges
    kv_repeat: int = 1  # Ulysses: each K/V head sent this many times (tp-local K/V heads fewer than cp)
    grad_width: float = 1.0  # float32 dK/dV over the compute width: what ring and all-gather send back
    expert_param_bytes: float = 0.0  # the rank's routed experts (1/ep of its MoE blocks'), as param_bytes
    expert_grad_bytes: float = 0.0  # and their gradients, as grad_bytes


def step_bytes(c: CommShape, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, zero: int = 0,
               microbatches: int = 1, dp_shard: int | None = None) -> dict[str, float]:
    """Bytes this rank sends in one step, per mesh dimension (``DIMS``; under hybrid sharding, ``dp_shard`` below
    dp, the rows ``dp_shard`` and ``dp_replicate`` stand for ``dp``: ``hybrid_bytes``)."""
    m = microbatches
    if dp_shard is not None and dp_shard < dp:
        data = hybrid_bytes(c.param_bytes, c.grad_bytes, dp_shard * cp, dp // dp_shard, zero, m, pipelined=pp > 1)
    else:
        data = {"dp": data_parallel_bytes(c.param_bytes, c.grad_bytes, dp * cp, zero, m, pipelined=pp > 1)}
    if c.expert_grad_bytes:  # the routed experts' own group: the dp x cp / ep ranks holding the same ones
        row = "dp_shard" if "dp_shard" in data else "dp"
        data[row] += data_parallel_bytes(c.expert_param_bytes, c.expert_grad_bytes, dp * cp // ep, zero, m,
                                         pipelined=pp > 1)
    return {
        **data,
        "tp": m * ((c.blocks * 4 + c.sp_edges) * all_reduce(c.hidden_bytes, tp) + all_gather(c.logit_bytes, tp)
                   * c.holds_head) + all_reduce(c.norm_bytes, tp),
        "pp": m * c.boundary_bytes * c.boundaries if pp > 1 else 0.0,
        "cp": m * c.blocks * cp_bytes(c, cp),
        "ep": m * c.moe_blocks * 4 * all_to_all(c.top_k * c.hidden_bytes, ep),
    }


def cp_bytes(c: CommShape, cp: int) -> float:
    """Bytes one block's context-parallel attention sends per microbatch, forward and backward (module doc)."""
    if cp <= 1:
        return 0.0
    if c.cp_impl == "ulysses":
        return 2 * all_to_all(2 * c.q_bytes + c.kv_repeat * c.kv_bytes, cp)
    if c.cp_impl == "allgather":
        return (cp - 1) * c.kv_bytes + all_to_all(cp * c.grad_width * c.kv_bytes, cp)
    return (2 + c.grad_width) * (cp - 1) * c.kv_bytes


def data_parallel_bytes(param_bytes: float, grad_bytes: float, dp: int, zero: int, microbatches: int = 1,
                        pipelined: bool = False) -> float:
    """The dp row of ``step_bytes`` (see the module docstring for each ZeRO stage)."""
    if dp <= 1:
        return 0.0
    if zero == 0:
        return all_reduce(grad_bytes, dp)
    if zero == 1:  # reduce-scatter, step the slice, all-gather it (workers/parallel/distributed_optimizer.py)
        return reduce_scatter(grad_bytes, dp) + all_gather(param_bytes, dp)
    gathers = parameter_gathers(zero, microbatches, pipelined)
    return reduce_scatter(grad_bytes, dp) + gathers * all_gather(param_bytes, dp)


def hybrid_bytes(param_bytes: float, grad_bytes: float, shard: int, replicas: int, zero: int, microbatches: int = 1,
                 pipelined: bool = False) -> dict[str, float]:
    """The dp rows under hybrid sharding: ZeRO's own collectives over the ``shard`` ranks of a shard group, and
    the all-reduce of this rank's reduced gradient slice (1/shard of the gradients) over the ``replicas``."""
    return {"dp_shard": data_parallel_bytes(param_bytes, grad_bytes, shard, zero, microbatches, pipelined),
            "dp_replicate": all_reduce(grad_bytes / shard, replicas)}


def parameter_gathers(zero: int, microbatches: int, pipelined: bool) -> int:
    """All-gathers of a stage's parameters per step under FSDP2 (ZeRO-2/3).

    Without a pipeline, each microbatch gathers for forward, and under ZeRO-3 again for backward. A
    ``PipelineStage`` keeps parameters gathered after backward: ZeRO-2 gathers once; under ZeRO-3 each forward
    still reshards, so a forward or backward finding them sharded gathers: m + 1 in all (measured on 1F1B).
    """
    if pipelined:
        return microbatches + 1 if zero >= 3 else 1
    return microbatches * (2 if zero >= 3 else 1)
