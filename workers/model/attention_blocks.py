"""Attention in blocks: the fused kernels that return a block's log-sum-exp, the online softmax that merges blocks,
and the sparse tiles a block is cut into under document masks and sliding windows. Context parallelism
(``workers.parallel.context_parallel``) runs these over K/V blocks from other ranks; ``blockwise_attention`` runs
them over a whole sequence on one process, where a document mask or a window would otherwise need a dense
``[S, S]`` SDPA mask.

Layout (shared with the data loader and the rotary embeddings): a sequence of ``S`` tokens is cut into
``2 * cp`` equal chunks and cp rank ``r`` holds chunk ``r`` followed by chunk ``2 * cp - 1 - r``
(``zigzag_indices``); one process (cp=1) holds the whole sequence in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.model.attention_ops import register_attention
from workers.model.documents import Documents, document_mask


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


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Refuse shapes the contract does not allow before any rank starts communicating."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"context-parallel attention wants q [B, Hq, S_local, D] and k, v [B, Hkv, S_local, D]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads Hq={q.shape[1]} must be a multiple of key/value heads Hkv={k.shape[1]} (GQA)")


Piece = tuple[slice, slice, bool]  # (local query rows, key columns of the block, whether to mask by position)
Tile = tuple[slice, slice, "torch.Tensor | bool | None"]  # (query rows, key columns, mask: a boolean tensor; True
# causal, by the fused kernel's own mask; None attends to all)
ROW_TILE = 512  # query rows per score tile: bounds the transient scores to ROW_TILE x S_local per head


def _tiles(pieces: list[Piece], s_local: int) -> list[Piece]:
    """``pieces`` cut into tiles of at most ``ROW_TILE`` query rows each.

    Why: a piece's scores and probabilities are ``rows x keys`` per head; at long local sequences a whole
    piece's would be the largest tensor of the step (2048 x 2048 x 32 heads in float32 is 512 MiB), so the
    rows are taken a tile at a time, as flash attention does, and the working memory stays linear in S.
    """
    out = []
    for rows, cols, masked in pieces:
        start, stop, _ = rows.indices(s_local)
        out += [(slice(t, min(t + ROW_TILE, stop)), cols, masked) for t in range(start, stop, ROW_TILE)]
    return out


def _block_plan(rank: int, src: int, causal: bool, half: int) -> list[Piece]:
    """The pieces of rank ``src``'s K/V block this rank's queries attend to; fully masked parts are skipped.

    Zigzag layout, causal: rank r holds chunks (r, 2cp-1-r). Its own block is the diagonal: the early query
    chunk sees only the early key chunk (masked by position), the late query chunk sees both (masked). A lower
    rank's block (src < r): both query chunks come after key chunk ``src`` and before key chunk
    ``2cp-1-src``, so all queries see exactly the first half of the keys, unmasked. A higher rank's block
    (src > r): query chunk r precedes both key chunks, query chunk ``2cp-1-r`` follows both, so only the
    second half of the queries attends, to all keys, unmasked. Every rank thus does the same work per step:
    the load balance the layout exists for.
    """
    every, first, second = slice(None), slice(0, half), slice(half, None)
    if not causal:
        return [(every, every, False)]
    if src == rank:
        return [(first, first, True), (second, every, True)]
    if src < rank:
        return [(every, first, False)]
    return [(second, every, False)]


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, Hq, S, D]`` -> ``[B, Hkv, G, S, D]`` in float32: each KV head's G query heads side by side (GQA)."""
    b, hq, s, d = q.shape
    return q.float().reshape(b, hkv, hq // hkv, s, d)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, G, S, D]`` -> ``[B, Hkv, G*S, D]``: a KV head's query rows stacked, so one matmul against
    ``[B, Hkv, S_k, D]`` keys serves the whole group without repeating K/V, and products with the transposed
    rows (dK, dV) sum over the group for free."""
    return x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a row whose every key is masked) as 0, to subtract: exp(-inf - -inf) would be NaN,
    exp(-inf - 0) is the 0 such a row must contribute. Finite entries are unchanged, so is the causal path."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _probabilities(q, k, scale: float, mask: torch.Tensor | None, lse: torch.Tensor | None = None):
    """Softmax of the scaled, masked scores of grouped queries ``q`` over keys ``k``, as ``[B, Hkv, G*Sq, Sk]``,
    with the log-sum-exp ``[B, Hkv, G, Sq]`` it used (computed here unless the forward's is given).

    A row the mask hides entirely (a document boundary can, in a block) gets probabilities 0 and lse -inf."""
    s = torch.matmul(_flat(q), k.transpose(-1, -2)).mul_(scale).view(*q.shape[:-1], k.shape[-2])
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1) if lse is None else lse
    return _flat(s.sub_(_finite(lse).unsqueeze(-1)).exp_()), lse


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online softmax: fold a block's (output, lse) into the running (output, lse) in place. A block lse of -inf
    (no key seen) leaves the row as it was, even while its running lse is -inf too (``_finite``)."""
    new = torch.logaddexp(lse, block_lse)
    shift = _finite(new)
    out.mul_(torch.exp(lse - shift).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - shift).unsqueeze(-1))
    lse.copy_(new)


def _block_backward(q, k, v, dout, lse, delta, scale, mask):
    """One piece's (dq, dk, dv) recomputed from the final log-sum-exp (the flash-attention backward)."""
    p, _ = _probabilities(q, k, scale, mask, lse)
    dout = _flat(dout)
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p.mul_(torch.matmul(dout, v.transpose(-1, -2)).sub_(_flat(delta.unsqueeze(-1))))
    dq = torch.matmul(ds, k).mul_(scale).view(q.shape)
    dk = torch.matmul(ds.transpose(-1, -2), _flat(q)).mul_(scale)
    return dq, dk, dv


class _BlockMasks:
    """Which tiles of each rank's K/V block this rank's queries attend to, each with its mask.

    Causal (or none): the pieces ``_block_plan`` keeps by position, cut by ``_fused_pieces`` so each goes whole
    through the fused kernel, its mask ``True`` (causal, on the diagonal) or ``None``. With ``documents``: the
    same pieces in row tiles, each masked causally within documents (``document_mask`` of the whole window's ids
    at the tile's global positions: no communication), and a tile whose every pair crosses a document boundary
    skipped. A tile's rows can still be all masked; ``_probabilities`` and ``_merge`` take that.
    """

    def __init__(self, rank: int, cp: int, s_local: int, causal: bool, documents: Documents | None,
                 window: int | None = None, device=None):
        self.rank, self.cp, self.s_local, self.documents, self.window = rank, cp, s_local, documents, window
        self.device = device
        # the document mask and the window are causal too
        self.causal = causal or documents is not None or window is not None

    def tiles(self, src: int) -> list[Tile]:
        """The tiles of rank ``src``'s block, with their masks (None: every key attended; True: causal)."""
        if self.documents is None and self.window is None:
            fused = _fused_pieces(self.rank, src, self.causal, self.s_local // 2)
            return [(rows, cols, True if masked else None) for rows, cols, masked in fused]
        # the fused pieces in row tiles: a square tile of the diagonal shares its queries' positions (causal)
        plan = _tiles(_fused_pieces(self.rank, src, self.causal, self.s_local // 2), self.s_local)
        if self.documents is None:
            return self._sparse_tiles(src, plan)
        key = ("ring", self.rank, src, self.s_local, ROW_TILE, self.window)  # every layer, fwd and bwd, asks alike
        return self.documents.cached(key, lambda: self._sparse_tiles(src, plan))

    def _sparse_tiles(self, src: int, plan: list[Piece]) -> list[Tile]:
        """``plan``'s row tiles cut into square tiles and masked within documents and the window: a tile nothing
        attends is dropped, one wholly attended (or causal on the diagonal) goes through the fused kernel, and only
        those a document boundary or the window's edge crosses keep a boolean mask, so the masks held are a few
        tiles per boundary, not O(S^2). One device sync per row tile."""
        ids = None if self.documents is None else self.documents.ids
        device = self.device if ids is None else ids.device
        seq = self.s_local * self.cp
        # one process holds the whole sequence in order, of any length (zigzag wants two equal chunks a rank)
        q_pos, k_pos = (torch.arange(seq) if self.cp == 1 else zigzag_indices(seq, self.cp, r).to(device)
                        for r in (self.rank, src))
        q_pos, k_pos = q_pos.to(device), k_pos.to(device)
        out = []
        for rows, cols, _ in plan:
            start, stop, _ = cols.indices(self.s_local)
            tiles = [slice(c, min(c + ROW_TILE, stop)) for c in range(start, stop, ROW_TILE)]
            masks = [window_mask(q_pos[rows], k_pos[tile], self.window) for tile in tiles]
            if ids is not None:
                masks = [m & document_mask(ids, q_pos[rows], k_pos[tile]) for m, tile in zip(masks, tiles)]
            masks = [m.unsqueeze(1) for m in masks]  # [B or 1, 1, 1, rows, keys]: over grouped heads [B, Hkv, G]
            kinds = _classified(masks, q_pos[rows], [k_pos[tile] for tile in tiles])
            out += [(rows, tile, kind) for tile, kind in zip(tiles, kinds) if kind is not False]
        return out


def _fused_pieces(rank: int, src: int, causal: bool, half: int) -> list[Piece]:
    """``_block_plan``'s pieces as the fused kernel's own mask can take them, each unmasked or square and causal
    (``is_causal``). The diagonal (a rank's own block) is one causal piece: a rank's positions rise through both its
    chunks, so causal by local index is causal by global position, and one kernel call (one merge, one backward)
    replaces three, the kernel skipping the masked half itself."""
    if causal and src == rank:
        return [(slice(None), slice(None), True)]
    return _block_plan(rank, src, causal, half)  # another rank's block: unmasked pieces


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[1, 1, len(q_pos), len(k_pos)]`` bool: causal, and (with ``window``) a key fewer than ``window``
    positions back, as ``transformers``' sliding window (Mistral: ``kv_idx > q_idx - sliding_window``)."""
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = diff >= 0
    if window is not None:
        allowed &= diff < window
    return allowed[None, None]


def _classified(masks: list[torch.Tensor], q_pos: torch.Tensor, k_pos: list[torch.Tensor]) -> list:
    """Each tile's mask as the kernels take it: False (nothing attended: drop the tile), None (all attended),
    True (exactly causal over the same positions: the fused kernel's own mask) or the boolean tensor. The tests
    of every tile are read back at once (one device sync)."""
    causal = [torch.equal(q_pos, k) for k in k_pos]  # positions: small, and on the host for the window's
    flags = torch.stack([torch.stack([m.any(), m.all(), (m == window_mask(q_pos, k, None)).all() if same
                                      else m.new_zeros((), dtype=torch.bool)])
                         for m, k, same in zip(masks, k_pos, causal)]).tolist()
    return [False if not some else None if every else True if diagonal else m
            for m, (some, every, diagonal) in zip(masks, flags)]


def _kernel_forward(q, k, v, causal: bool, scale: float):
    """(out ``[B, Hq, Sq, D]``, lse float32 ``[B, Hq, Sq]``) of one block by the device's fused attention kernel.

    CPU: the flash-for-CPU kernel (grouped K/V heads taken as they are). CUDA: memory-efficient attention (any
    float dtype, every GPU generation), K/V heads repeated for GQA; its lse is padded to 32 rows, cut here.
    """
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                              scale=scale)
    return out, lse[..., :q.shape[2]]


def _kernel_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of one block by the fused kernel's backward, given the *merged* output and lse of the whole
    row: the kernel then recomputes this block's probabilities as shares of the whole softmax, so the block's
    gradients are its exact part of the full attention's (the flash-attention backward, blockwise)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    hkv = k.shape[1]
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    padded = F.pad(lse, (0, -lse.shape[-1] % 32)).contiguous()  # the kernel reads lse in 32-row blocks
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, padded, seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, _sum_heads(dk, hkv), _sum_heads(dv, hkv)


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, Hkv, S, D]`` with each K/V head repeated for its query heads (GQA on a kernel without it)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_heads(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """The inverse of ``_repeat_heads`` for gradients: each K/V head's copies summed."""
    b, h, s, d = t.shape
    return t if h == hkv else t.view(b, hkv, h // hkv, s, d).sum(2)


class _State:
    """A forward's running result: float32 output ``[B, Hkv, G, S, D]`` and lse ``[B, Hkv, G, S]`` (grouped, so
    the tile kernels' GQA products and the fused kernels' ``[B, Hq, ...]`` results are views of one another).

    The output takes q's memory layout (``_dq_accumulator``'s reason): the model's q is a transposed
    ``[B, S, H, D]`` projection, so the output transposed back for ``wo`` is a view, not a saved copy."""

    def __init__(self, q: torch.Tensor, hkv: int, sinks: torch.Tensor | None = None):
        self.q, self.hkv = q, hkv
        self.out = _dq_accumulator(q, hkv)
        self.lse = torch.full(self.out.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        if sinks is not None:  # the sink: a key every row sees, of logit sinks[h] and value 0 (``sink_gradient``)
            self.lse.copy_(sinks.detach().float().view(1, hkv, -1, 1).expand_as(self.lse))
        self._qg = None

    @property
    def qg(self) -> torch.Tensor:
        """q grouped in float32, what the tile kernels take, made once when first needed."""
        if self._qg is None:
            self._qg = _grouped(self.q, self.hkv)
        return self._qg

    def merge(self, rows: slice, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
        """Fold a block's (out, lse) over query rows ``rows``, grouped or ``[B, Hq, ...]``, into the running ones."""
        out, lse = self.out[..., rows, :], self.lse[..., rows]
        _merge(out, lse, block_out.float().view(out.shape), block_lse.view(lse.shape))

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(output ``[B, Hq, S, D]`` in q's dtype, lse ``[B, Hq, S]``): what the backward is handed."""
        return self.out.flatten(1, 2).to(self.q.dtype), self.lse.view(self.q.shape[:-1])


def _attend_block(state: _State, kv, tiles: list[Tile]) -> None:
    """Fold a K/V block ``kv`` ``[2, B, Hkv, S_local, D]`` into the running (out, lse) in place, tile by tile:
    a tile with a boolean mask by the blockwise matmuls, one whose mask is ``True`` (causal) or ``None`` by the
    fused kernel."""
    q, (k, v) = state.q, kv
    scale = q.shape[-1] ** -0.5
    for rows, cols, mask in tiles:
        if isinstance(mask, torch.Tensor):
            p, block_lse = _probabilities(state.qg[..., rows, :], k[..., cols, :].float(), scale, mask)
            block_out = torch.matmul(p, v[..., cols, :].float())
        else:
            block_out, block_lse = _kernel_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], bool(mask), scale)
        state.merge(rows, block_out, block_lse)


def _block_gradients(saved: dict, kv, tiles: list[Tile], dq) -> torch.Tensor:
    """dK/dV ``[2, B, Hkv, S_local, D]`` of a K/V block; its share of dQ is added to ``dq`` (grouped) in place.

    ``saved`` holds what every block's backward shares: q, dout, the merged output and lse, and for the tile
    kernels their grouped float32 forms and delta.
    """
    q = saved["q"]
    k, v = kv
    scale = q.shape[-1] ** -0.5
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    for rows, cols, mask in tiles:
        if isinstance(mask, torch.Tensor):
            grouped = saved["grouped"]()
            piece_dq, piece_dk, piece_dv = _block_backward(
                grouped["qg"][..., rows, :], k[..., cols, :].float(), v[..., cols, :].float(),
                grouped["doutg"][..., rows, :], grouped["lse"][..., rows], grouped["delta"][..., rows], scale, mask)
        else:
            piece_dq, piece_dk, piece_dv = _kernel_backward(
                saved["dout"][:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols], saved["out"][:, :, rows],
                saved["lse"][..., rows], bool(mask), scale)
        dq[..., rows, :] += piece_dq.view(dq[..., rows, :].shape)
        dkv[0, ..., cols, :] += piece_dk  # pieces and tiles overlap in keys: accumulate
        dkv[1, ..., cols, :] += piece_dv
    return dkv


def _dq_accumulator(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """Zeroed float32 ``[B, Hkv, G, S, D]`` in q's memory layout (``zeros_like`` keeps its strides), what dQ and
    the output accumulate in: a tensor laid out as q is reshapes back to q's layout without a copy."""
    b, hq, s, d = q.shape
    return torch.zeros_like(q, dtype=torch.float32).view(b, hkv, hq // hkv, s, d)


def _forward_state(q, k, rank: int, cp: int, causal: bool, documents: Documents | None = None,
                   window: int | None = None, sinks: torch.Tensor | None = None):
    """(block masks, running state) of cp rank ``rank`` of ``cp``: what every forward starts from (with
    ``sinks``, a running softmax that already holds each head's sink logit)."""
    masks = _BlockMasks(rank, cp, q.shape[2], causal, documents, window, q.device)
    return masks, _State(q, k.shape[1], sinks)


def _backward_state(dout, q, k, out, lse) -> dict:
    """What every block's backward shares (``_block_gradients``), from the saved forward and dout; the tile
    kernels' grouped float32 forms are made on first use (a causal job's fused blocks never need them)."""
    hkv, cache = k.shape[1], {}

    def grouped() -> dict:
        if not cache:
            doutg = _grouped(dout, hkv)
            cache.update(qg=_grouped(q, hkv), doutg=doutg, lse=lse.view(doutg.shape[:-1]),
                         delta=(doutg * _grouped(out, hkv)).sum(-1))
        return cache
    return {"q": q, "dout": dout.contiguous(), "out": out, "lse": lse, "grouped": grouped}


def gradients(dq: torch.Tensor, dkv: torch.Tensor, q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the inputs' dtypes from the float32 accumulators: dq grouped, dK/dV stacked ``[2, ...]``
    (each its own tensor: an operator's outputs may not alias one another)."""
    return dq.reshape(q.shape).to(q.dtype), dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True)


def _blockwise_forward(q, k, v, sinks, documents: Documents | None, window: int | None, causal: bool, group: str):
    """One process's whole sequence as a single block: the tiles of ``_BlockMasks`` (rank 0 of 1) folded into the
    online softmax (started from the sinks where given). (out, lse, nothing saved besides)."""
    masks, state = _forward_state(q, k, 0, 1, True, documents, window, sinks)
    _attend_block(state, torch.stack([k, v]), masks.tiles(0))
    return *state.result(), q.new_empty(0)


def _blockwise_backward(dout, q, k, v, out, lse, saved, documents: Documents | None, window: int | None,
                        causal: bool, group: str):
    """Each tile's gradients from the merged lse (the flash-attention backward, tile by tile)."""
    masks = _BlockMasks(0, 1, q.shape[2], True, documents, window, q.device)
    dq = _dq_accumulator(q, k.shape[1])
    dkv = _block_gradients(_backward_state(dout, q, k, out, lse), torch.stack([k, v]), masks.tiles(0), dq)
    return gradients(dq, dkv, q, k, v)


_blockwise = register_attention("blockwise_attention", _blockwise_forward, _blockwise_backward)


def blockwise_attention(q, k, v, documents: Documents | None = None, window: int | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a whole sequence on one process within ``documents`` and/or a sliding ``window``: the
    ring's sparse tiles without a ring, so no ``[S, S]`` mask is built (SDPA would need a dense one)
    and tiles nothing attends are skipped. ``sinks`` [Hq] (gpt-oss's attention sinks): one more logit per head in
    every row's softmax, of value zero, exactly: the online softmax starts from it. Custom operators
    (``workers.model.attention_ops``): compiled blocks trace around them."""
    _check_heads(q, k, v)
    return _blockwise(q, k, v, documents, window, True, "", sinks)
