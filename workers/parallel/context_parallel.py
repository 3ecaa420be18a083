"""Context parallelism: attention over a sequence split across the ranks of a cp process group.

Why our own: PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` runs only on CUDA (it
patches the flash/efficient SDPA kernels); raymesh trains on gloo (CPU) as well as NCCL, so the three
strategies here use nothing but ``torch.distributed`` point-to-point and collective calls and plain tensor
maths.

Layout (shared with the data loader and the rotary embeddings): a sequence of ``S`` tokens is cut into
``2 * cp`` equal chunks and cp rank ``r`` holds chunk ``r`` followed by chunk ``2 * cp - 1 - r``
(``zigzag_indices``). Under a causal mask every rank then holds one early and one late chunk, so each does
the same amount of attention work.

Every function takes the local ``q`` ``[B, Hq, S_local, D]`` and ``k``/``v`` ``[B, Hkv, S_local, D]`` (GQA:
``Hq`` a multiple of ``Hkv``) and returns the local queries' output ``[B, Hq, S_local, D]``, equal to
single-device ``scaled_dot_product_attention`` over the whole sequence (causal by global position), with
gradients for q, k and v through autograd:

- ``allgather_attention``: all-gather K/V, attend the local queries to the whole sequence (Llama 3 style);
- ``ring_attention``: K/V blocks travel round the ring, overlapped with blockwise online-softmax attention;
- ``ulysses_attention``: all-to-all from sequence-sharded to head-sharded, whole-sequence SDPA, and back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workers.model.attention_blocks import (  # the blocks' maths; zigzag_indices stays importable from here
    _attend_block,
    _backward_state,
    _block_gradients,
    _BlockMasks,
    _check_heads,
    _dq_accumulator,
    _forward_state,
    blockwise_attention,
    gradients,
    zigzag_indices,
)
from workers.model.attention_ops import custom_op, register_attention
from workers.model.documents import Documents


def _group_shape(group) -> tuple[int, int]:
    """(this rank's index in ``group``, the group's size)."""
    return dist.get_rank(group), dist.get_world_size(group)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 (slot ``j`` goes to rank ``j``; slot ``j`` of the result came from it)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _all_to_all_named(x: torch.Tensor, group: str) -> torch.Tensor:
    """``_all_to_all`` over the group named ``group``."""
    return _all_to_all(x, _resolve(group))


# ``_all_to_all`` as an operator (the group by name), so Ulysses' exchanges sit in a compiled block whole
_all_to_all_op = custom_op("all_to_all", _all_to_all_named, "(Tensor x, str group) -> Tensor")


@_all_to_all_op.register_fake
def _(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# its gradient is the same exchange run backwards (equal splits)
_all_to_all_op.register_autograd(lambda ctx, grad: (_all_to_all_op(grad, ctx.group), None),
                                 setup_context=lambda ctx, inputs, output: setattr(ctx, "group", inputs[1]))


def _resolve(group: str):
    """The process group named ``group`` (what an operator is handed: ``group_name``)."""
    return dist.distributed_c10d._resolve_process_group(group)


@dataclass(frozen=True)
class GroupRef:
    """A process group as the operators take it, by name, with its size: what a compiled block is handed
    (``workers.parallel.context_layout.ContextShard``), since Dynamo traces neither a ``ProcessGroup`` nor the
    calls that ask one its size."""

    name: str
    size: int
    rank: int = 0  # this process's index in the group (Ulysses' head share: the sinks it takes)


def group_ref(group) -> GroupRef:
    """``group`` (a ``ProcessGroup``, None for the default group, or already a ``GroupRef``) as a ``GroupRef``."""
    if isinstance(group, GroupRef):
        return group
    group = group if group is not None else dist.group.WORLD
    return GroupRef(group.group_name, dist.get_world_size(group), dist.get_rank(group))


# --- ring attention -------------------------------------------------------------------------------------------


class _RingShift:
    """One step of the ring: send ``tensor`` to the next cp rank and receive the previous rank's, asynchronously.

    Started before a block's computation and waited on after it, so the transfer overlaps the maths. ``tag``
    keeps the K/V stream and the dK/dV stream of the backward apart on backends that match messages by tag.
    """

    def __init__(self, tensor: torch.Tensor, group, tag: int):
        rank, cp = _group_shape(group)
        peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.sent = tensor.contiguous()
        self.received = torch.empty_like(self.sent)
        ops = [dist.P2POp(dist.isend, self.sent, peer((rank + 1) % cp), group, tag),
               dist.P2POp(dist.irecv, self.received, peer((rank - 1) % cp), group, tag)]
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        return self.received


def _ring_forward(q, k, v, sinks, documents: Documents | None, window: int | None, causal: bool, group: str):
    """Ring attention: K/V travel round the cp ring; dK/dV travel round it again in the backward.

    Forward: cp steps; at step ``t`` this rank holds rank ``(r - t) % cp``'s K/V, attends its queries to the
    tiles ``_BlockMasks`` keeps and folds each into a running output and log-sum-exp, while the next block is
    already in flight. Only q, k, v, the output and the log-sum-exp are saved. (out, lse, nothing else saved).
    With ``sinks`` each row's running softmax starts from its head's sink, once, before the first block.
    """
    pg = _resolve(group)
    masks, state = _forward_state(q, k, *_group_shape(pg), causal, documents, window, sinks)
    rank, cp = masks.rank, masks.cp
    kv = torch.stack([k, v])
    for step in range(cp):
        shift = _RingShift(kv, pg, tag=0) if step + 1 < cp else None
        _attend_block(state, kv, masks.tiles((rank - step) % cp))
        kv = shift.wait() if shift else kv
    return *state.result(), q.new_empty(0)


def _ring_backward(dout, q, k, v, out, lse, saved, documents: Documents | None, window: int | None, causal: bool,
                   group: str):
    """Recompute each tile's probabilities from the saved log-sum-exp; dQ accumulates locally. A rank's own block
    comes first and its dK/dV stays here; each other block's dK/dV accumulator starts at its first visitor, travels
    with the block and after cp - 1 hops arrives at the owner, which adds it to its own share: cp - 1 dK/dV
    messages a rank (the accumulator starting at the owner would take cp, the last a round trip of the own share)."""
    pg = _resolve(group)
    masks = _block_masks(q, pg, causal, documents, window)
    rank, cp = masks.rank, masks.cp
    state = _backward_state(dout, q, k, out, lse)
    dq = _dq_accumulator(q, k.shape[1])
    kv, own, dkv_shift = torch.stack([k, v]), None, None
    for step in range(cp):
        kv_shift = _RingShift(kv, pg, tag=0) if step + 1 < cp else None
        block_dkv = _block_gradients(state, kv, masks.tiles((rank - step) % cp), dq)
        if step == 0:
            own = block_dkv
        else:  # the block's accumulated dK/dV arrives from the previous rank while the block computes
            dkv = block_dkv if dkv_shift is None else dkv_shift.wait().add_(block_dkv)
            dkv_shift = _RingShift(dkv, pg, tag=1)
        kv = kv_shift.wait() if kv_shift else kv
    return gradients(dq, own if dkv_shift is None else own.add_(dkv_shift.wait()), q, k, v)


def _block_masks(q, pg, causal: bool, documents: Documents | None, window: int | None) -> _BlockMasks:
    """This cp rank's block masks again, in backward (those of documents come from their cache)."""
    return _BlockMasks(*_group_shape(pg), q.shape[2], causal, documents, window, q.device)


def _allgather_forward(q, k, v, sinks, documents: Documents | None, window: int | None, causal: bool, group: str):
    """K/V all-gather attention (Llama 3's CP): every rank gathers the whole sequence's K/V and attends its
    queries to each rank's block with the same blockwise kernels as the ring (so causal work is balanced and
    no S_local x S mask or score matrix is ever built). (out, lse, the gathered K/V ``[cp, 2, B, Hkv, S, D]``);
    the running softmax starts from the ``sinks`` where given."""
    pg = _resolve(group)
    masks, state = _forward_state(q, k, *_group_shape(pg), causal, documents, window, sinks)
    blocks = [torch.empty(2, *k.shape, dtype=k.dtype, device=k.device) for _ in range(masks.cp)]
    dist.all_gather(blocks, torch.stack([k, v]), group=pg)
    for src, kv in enumerate(blocks):
        _attend_block(state, kv, masks.tiles(src))
    return *state.result(), torch.stack(blocks)


def _allgather_backward(dout, q, k, v, out, lse, blocks, documents: Documents | None, window: int | None,
                        causal: bool, group: str):
    """Each gathered block's dK/dV goes back to its owner with one all-to-all summed on arrival, a
    reduce-scatter that gloo (which has none) can run too."""
    pg = _resolve(group)
    masks = _block_masks(q, pg, causal, documents, window)
    state = _backward_state(dout, q, k, out, lse)
    dq = _dq_accumulator(q, k.shape[1])
    dkv = torch.stack([_block_gradients(state, kv, masks.tiles(src), dq) for src, kv in enumerate(blocks)])
    return gradients(dq, _all_to_all(dkv, pg).sum(0), q, k, v)


_ring = register_attention("ring_attention", _ring_forward, _ring_backward)
_allgather = register_attention("allgather_attention", _allgather_forward, _allgather_backward,
                                lambda k, group: (dist.get_world_size(_resolve(group)), 2, *k.shape))


def allgather_attention(q, k, v, group, causal: bool = True, documents: Documents | None = None,
                        window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """All-gather K/V over the cp group and attend the local queries to the whole sequence (Llama 3's CP).

    Simplest of the three: one collective each way, no ring; it holds the whole sequence's K/V per rank. With
    ``documents`` each query sees only its own document's earlier keys, with a sliding ``window`` only the keys
    fewer than ``window`` positions back: the ring's sparse tiles, per gathered block (no dense mask). ``sinks``
    [Hq]: gpt-oss's attention sinks (``workers.model.attention_ops``).
    """
    _check_heads(q, k, v)
    return _allgather(q, k, v, documents, window, causal, group_ref(group).name, sinks)


def ring_attention(q, k, v, group, causal: bool = True, documents: Documents | None = None,
                   window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the local queries over the whole sequence, K/V blocks passed round the cp ring.

    Memory per rank stays O(S_local): at any time a rank holds its own K/V, one block in flight and one
    block's scores. GQA is handled by grouping query heads per KV head (no repeated K/V). With ``documents``
    each query sees only its own document's earlier keys: every block's mask comes from the whole window's
    document ids, which every rank holds, and tiles that cross only document boundaries are skipped
    (``_BlockMasks``). With a sliding ``window`` a query sees only keys fewer than ``window`` positions back:
    tiles out of it are skipped, so the work falls with the window. ``sinks`` [Hq]: gpt-oss's attention sinks,
    each row's running softmax starting from its head's (``workers.model.attention_ops``).
    """
    _check_heads(q, k, v)
    return _ring(q, k, v, documents, window, causal, group_ref(group).name, sinks)


# --- Ulysses ----------------------------------------------------------------------------------------------------


def check_ulysses_heads(hq: int, hkv: int, cp: int) -> None:
    """Refuse head counts Ulysses cannot spread over ``cp`` ranks (called by the spec check too, before launch).

    Each rank attends with ``Hq/cp`` query heads, so ``Hq`` must divide by cp; key/value heads either split
    the same way (``Hkv % cp == 0``) or, fewer than cp, are replicated so every rank gets one
    (``cp % Hkv == 0``).
    """
    if hq % cp or (hkv % cp and cp % hkv):
        raise ValueError(
            f"ulysses attention at cp={cp} cannot split query heads Hq={hq} and key/value heads Hkv={hkv}: "
            f"Hq must be divisible by cp, and Hkv divisible by cp or cp divisible by Hkv; "
            f"pick a cp that fits these head counts (tensor-local heads under tp), or use cp_impl: ring"
        )


def _sequence_to_heads(t: torch.Tensor, group: GroupRef, cp: int) -> torch.Tensor:
    """``[B, H, S_local, D]`` -> ``[B, H/cp, S, D]``: this rank's head group over every rank's tokens (rank order)."""
    b, h, s, d = t.shape
    parts = _all_to_all_op(t.reshape(b, cp, h // cp, s, d).transpose(0, 1), group.name)
    return parts.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_sequence(t: torch.Tensor, group: GroupRef, cp: int) -> torch.Tensor:
    """``[B, H/cp, S, D]`` (tokens in rank order) -> ``[B, H, S_local, D]``: the inverse of ``_sequence_to_heads``."""
    b, h, s, d = t.shape
    parts = _all_to_all_op(t.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4), group.name)
    return parts.transpose(0, 1).reshape(b, cp * h, s // cp, d)


def ulysses_attention(q, k, v, group, causal: bool = True, documents: Documents | None = None,
                      window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSpeed-Ulysses: all-to-all to head-sharded whole sequences, SDPA, all-to-all back.

    After the first exchange the tokens sit in rank order (each rank's zigzag chunks); they are permuted to
    natural order so SDPA's own causal mask applies, and back before the return exchange. KV heads fewer than
    cp are replicated (``check_ulysses_heads`` says which counts work). Under tp the heads are the tp-local
    ones; nothing here changes. With ``documents``, a ``window`` or ``sinks`` every rank attends the whole sequence
    through ``blockwise_attention``; the sinks shard with the query heads (this rank's ``Hq/cp``, by its index in
    the group), so their gradient is this rank's heads' alone and the cp ranks' sum is the whole.
    """
    _check_heads(q, k, v)
    group = group_ref(group)
    cp = group.size
    hq, hkv = q.shape[1], k.shape[1]
    check_ulysses_heads(hq, hkv, cp)
    if hkv < cp:
        k, v = k.repeat_interleave(cp // hkv, dim=1), v.repeat_interleave(cp // hkv, dim=1)
    order = torch.cat([zigzag_indices(q.shape[2] * cp, cp, r) for r in range(cp)]).to(q.device)
    natural = torch.argsort(order)
    qh, kh, vh = (_sequence_to_heads(t, group, cp)[:, :, natural] for t in (q, k, v))
    if window is not None or documents is not None or sinks is not None:
        heads = hq // cp
        local_sinks = None if sinks is None else sinks[group.rank * heads:(group.rank + 1) * heads]
        out = blockwise_attention(qh, kh, vh, documents, window, local_sinks)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=qh.shape[1] != kh.shape[1], is_causal=causal)
    return _heads_to_sequence(out[:, :, order], group, cp)
