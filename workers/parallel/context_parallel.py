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

import torch
import torch.distributed as dist
import torch.nn.functional as F


def zigzag_indices(seq_len: int, cp: int, rank: int) -> torch.LongTensor:
    """Global token positions cp rank ``rank`` holds: chunk ``rank`` then chunk ``2*cp-1-rank`` of ``2*cp``.

    Why two chunks: with a causal mask the late tokens attend to far more keys than the early ones; pairing
    an early chunk with its mirror-image late chunk gives every rank the same causal work.
    """
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"zigzag_indices: rank={rank} must lie in [0, cp) with cp={cp} >= 1")
    if seq_len % (2 * cp):
        raise ValueError(
            f"zigzag_indices: seq_len={seq_len} is not divisible by 2*cp={2 * cp}; "
            f"use a sequence length that is a multiple of {2 * cp} (each cp rank holds two equal chunks)"
        )
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    mirror = 2 * cp - 1 - rank
    return torch.cat([first, torch.arange(mirror * chunk, (mirror + 1) * chunk)])


def _group_shape(group) -> tuple[int, int]:
    """(this rank's index in ``group``, the group's size)."""
    return dist.get_rank(group), dist.get_world_size(group)


def _causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, device) -> torch.Tensor:
    """Boolean mask (True = attend) of queries at global positions ``q_pos`` over keys at ``k_pos``."""
    return (q_pos[:, None] >= k_pos[None, :]).to(device)


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Refuse shapes the contract does not allow before any rank starts communicating."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"context-parallel attention wants q [B, Hq, S_local, D] and k, v [B, Hkv, S_local, D]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads Hq={q.shape[1]} must be a multiple of key/value heads Hkv={k.shape[1]} (GQA)")


class _GatherSequence(torch.autograd.Function):
    """All-gather a ``[..., S_local, D]`` tensor along the sequence (dim -2); backward reduce-scatters.

    Why our own: ``torch.distributed.nn.functional.all_gather`` is deprecated, and on gloo its backward
    (an all-to-all of non-contiguous gradient slices) returns wrong gradients; gloo has no reduce-scatter,
    so the backward here is an ``all_to_all_single`` of contiguous chunks summed on arrival, which moves the
    same bytes as a reduce-scatter on any backend.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp = dist.get_world_size(ctx.group)
        chunks = torch.stack(grad.chunk(cp, dim=-2)).contiguous()
        received = torch.empty_like(chunks)
        dist.all_to_all_single(received, chunks, group=ctx.group)
        return received.sum(0), None


def allgather_attention(q, k, v, group, causal: bool = True) -> torch.Tensor:
    """All-gather K/V over the cp group and attend the local queries to the whole sequence (Llama 3's CP).

    The gathered K/V stay in rank order (zigzag, not natural order): attention does not care about key
    order as long as the causal mask compares global positions, which it does.
    """
    _check_heads(q, k, v)
    rank, cp = _group_shape(group)
    s_local = q.shape[2]
    k_all, v_all = _GatherSequence.apply(torch.stack([k, v]), group)
    mask = None
    if causal:
        seq = s_local * cp
        k_pos = torch.cat([zigzag_indices(seq, cp, r) for r in range(cp)])
        mask = _causal_mask(zigzag_indices(seq, cp, rank), k_pos, q.device)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
