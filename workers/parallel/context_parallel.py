"""Context-parallel attention kernels (placeholder until the ``cp-attn`` branch lands its ring and Ulysses).

Only the shared contract lives here for now: ``zigzag_indices`` and ``allgather_attention``; the ``cp-attn``
branch owns this module and replaces it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def zigzag_indices(seq_len: int, cp: int, rank: int) -> torch.LongTensor:
    """Global token positions cp rank ``rank`` holds: chunk ``rank`` then chunk ``2*cp-1-rank`` of ``2*cp``."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} is not divisible by 2*cp={2 * cp}")
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat((torch.arange(first, first + chunk), torch.arange(second, second + chunk)))


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dim; backward sums every rank's gradient and keeps this rank's slice
    (an all-reduce: gloo has no reduce-scatter, and PyTorch's autograd all_gather breaks on gloo sub-groups)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.local = group, dist.get_rank(group), x.shape[2]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(2, ctx.rank * ctx.local, ctx.local), None


def allgather_attention(q, k, v, group, causal: bool = True) -> torch.Tensor:
    """Attention of the local queries over the whole sequence's K/V, all-gathered (Llama 3's way)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    local = q.shape[2]
    keys, values = _GatherSequence.apply(k, group), _GatherSequence.apply(v, group)
    mask = None
    if causal:
        q_pos = zigzag_indices(local * cp, cp, rank).to(q.device)
        k_pos = torch.cat([zigzag_indices(local * cp, cp, r) for r in range(cp)]).to(q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
