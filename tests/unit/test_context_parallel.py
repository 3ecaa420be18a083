"""Context-parallel attention (ring, Ulysses, all-gather) equals single-process SDPA on the whole sequence.

One spawn of four gloo ranks runs every case, at cp=4 and at cp=2 (two pairs), in a module-scoped fixture;
each test reads its case: output and dq/dk/dv to 1e-5 in float32, causal, not, and causal within documents
(``model.attention_mask: document``), within a sliding window (``model.sliding_window``), alone and with
documents, MHA/GQA/MQA head counts, and Ulysses' refusal of head counts it cannot
split. Ring attention's tiles under the document mask are checked without a group too.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.cp_attention import DOCUMENTS, HEADS, MASKS, SINK_MASKS, WINDOWS, document_layout, run_all
from workers.model import attention_blocks as blocks
from workers.model.attention_blocks import _block_plan, zigzag_indices
from workers.model.documents import Documents, document_mask
from workers.parallel.context_parallel import check_ulysses_heads

STRATEGIES = ("allgather", "ring", "ulysses")
TOL = 1e-5
CASES = [(cp, strategy, label, hq, hkv, causal) for cp in (2, 4) for strategy in STRATEGIES
         for label, hq, hkv in HEADS for causal in MASKS]
NAMES = {True: "causal", False: "full", **{name: name.replace(" ", "-") for name in (*DOCUMENTS, *WINDOWS)}}


def _ulysses_splits(hq: int, hkv: int, cp: int) -> bool:
    """Whether Ulysses can place these heads: query heads split by cp, KV heads split or replicated."""
    return hq % cp == 0 and (hkv % cp == 0 or cp % hkv == 0)


@pytest.fixture(scope="module")
def results():
    return run_all(4, STRATEGIES)


def test_zigzag_pairs_each_early_chunk_with_its_mirror():
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([zigzag_indices(24, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(24))


def test_zigzag_refuses_a_sequence_it_cannot_split_evenly():
    with pytest.raises(ValueError, match="seq_len=10 is not divisible by 2\\*cp=4"):
        zigzag_indices(10, 2, 0)


@pytest.mark.parametrize(("hq", "hkv", "cp"), [(6, 3, 2), (6, 2, 4), (4, 3, 2)])
def test_ulysses_refusal_names_the_rule(hq, hkv, cp):
    with pytest.raises(ValueError, match=f"cp={cp} cannot split query heads Hq={hq} and key/value heads Hkv={hkv}"):
        check_ulysses_heads(hq, hkv, cp)


@pytest.mark.parametrize(("cp", "strategy", "label", "hq", "hkv", "causal"), CASES,
                         ids=[f"cp{c[0]}-{c[1]}-{c[2]}-{NAMES[c[5]]}" for c in CASES])
def test_matches_single_process_sdpa(results, cp, strategy, label, hq, hkv, causal):
    err = results[(cp, strategy, label, causal)]
    if strategy == "ulysses" and not _ulysses_splits(hq, hkv, cp):
        assert isinstance(err, str) and "Hq must be divisible by cp, and Hkv divisible by cp" in err, err
        return
    assert isinstance(err, float), err
    assert err < TOL, f"{strategy} cp={cp} {label} causal={causal}: max |diff| {err:.3g}"


SINK_CASES = [(cp, strategy, label, hq, hkv, causal) for cp in (2, 4) for strategy in STRATEGIES
              for label, hq, hkv in HEADS for causal in SINK_MASKS]


@pytest.mark.parametrize(("cp", "strategy", "label", "hq", "hkv", "causal"), SINK_CASES,
                         ids=[f"cp{c[0]}-{c[1]}-{c[2]}-{NAMES[c[5]]}-sinks" for c in SINK_CASES])
def test_attention_sinks_match_the_softmax_with_an_extra_logit(results, cp, strategy, label, hq, hkv, causal):
    """gpt-oss's sinks through every kernel: output, dq/dk/dv and the sinks' gradient (summed over the cp ranks, as
    the gradient reduction does) equal the dense softmax with one extra logit per head; Ulysses deals the sinks
    out with the query heads."""
    err = results[(cp, strategy, label, causal, "sinks")]
    if strategy == "ulysses" and not _ulysses_splits(hq, hkv, cp):
        assert isinstance(err, str) and "Hq must be divisible by cp" in err, err
        return
    assert isinstance(err, float), err
    assert err < TOL, f"{strategy} cp={cp} {label} {causal} with sinks: max |diff| {err:.3g}"


def _pairs_attended(cp: int, rank: int, src: int, seq: int) -> tuple[set, int]:
    """The (query, key) global positions the ring's pieces let through for one block, and the work (score cells)."""
    half = seq // (2 * cp)
    q_pos, k_pos = zigzag_indices(seq, cp, rank), zigzag_indices(seq, cp, src)
    pairs, work = set(), 0
    for rows, cols, masked in _block_plan(rank, src, True, half):
        work += len(q_pos[rows]) * len(k_pos[cols])
        pairs |= {(int(q), int(k)) for q in q_pos[rows] for k in k_pos[cols] if not masked or q >= k}
    return pairs, work


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_pieces_cover_exactly_the_causal_pairs_with_equal_work_per_rank(cp):
    seq = 4 * cp
    for step in range(cp):
        works = []
        for rank in range(cp):
            src = (rank - step) % cp
            pairs, work = _pairs_attended(cp, rank, src, seq)
            q_pos, k_pos = zigzag_indices(seq, cp, rank).tolist(), zigzag_indices(seq, cp, src).tolist()
            assert pairs == {(q, k) for q in q_pos for k in k_pos if q >= k}
            works.append(work)
        assert len(set(works)) == 1, f"step {step}: unequal work per rank {works}"


def _document_pairs(ids: torch.Tensor, tiles, q_pos, k_pos) -> set:
    """The (sequence, query, key) global positions ring attention's document-masked tiles of one block let through
    (a tile without a mask attends every pair, a causal one each pair in causal order)."""
    pairs = set()
    for rows, cols, mask in tiles:
        if not isinstance(mask, torch.Tensor):
            qs, ks = q_pos[rows], k_pos[cols]
            allowed = blocks.window_mask(qs, ks, None) if mask else torch.ones(1, 1, len(qs), len(ks), dtype=torch.bool)
            mask = allowed.unsqueeze(1).expand(len(ids), -1, -1, -1, -1)
        for b, _, _, i, j in mask.nonzero().tolist():
            pairs.add((b, int(q_pos[rows][i]), int(k_pos[cols][j])))
    return pairs


def _candidate_tiles(rank: int, src: int, cp: int, s_local: int) -> int:
    """The square tiles a block's pieces cut into before any is dropped."""
    plan = blocks._tiles(blocks._fused_pieces(rank, src, True, s_local // 2), s_local)
    return sum(-(-len(range(*cols.indices(s_local))) // blocks.ROW_TILE) for _, cols, _ in plan)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_tiles_under_the_document_mask_keep_exactly_the_pairs_within_documents(cp, monkeypatch):
    """Every block's tiles let through each (query, key) of one document in causal order and nothing else, skip
    tiles no sequence attends to, send some whole to the fused kernel, and keep masks whose rows see no key (the
    kernel's -inf lse case) only where a boundary crosses."""
    monkeypatch.setattr(blocks, "ROW_TILE", 4)
    seq = 24
    ids = document_layout(seq, DOCUMENTS["split documents"])
    documents, skipped, blind_rows, fused = Documents(ids), 0, 0, 0
    for rank in range(cp):
        masks = blocks._BlockMasks(rank, cp, seq // cp, True, documents)
        for src in range(cp):
            q_pos, k_pos = zigzag_indices(seq, cp, rank), zigzag_indices(seq, cp, src)
            tiles = masks.tiles(src)
            assert _document_pairs(ids, tiles, q_pos, k_pos) == {
                (b, int(q), int(k)) for b in range(len(ids)) for q in q_pos for k in k_pos
                if q >= k and ids[b, q] == ids[b, k]}
            skipped += _candidate_tiles(rank, src, cp, seq // cp) - len(tiles)
            fused += sum(not isinstance(mask, torch.Tensor) for _, _, mask in tiles)
            blind_rows += sum(int((~mask.any(-1)).sum()) for _, _, mask in tiles if isinstance(mask, torch.Tensor))
    assert skipped > 0 and blind_rows > 0 and fused > 0, (skipped, blind_rows, fused)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_a_microbatch_of_one_document_keeps_no_mask_and_the_planner_counts_none(cp, monkeypatch):
    """Causal within one document is causal: every tile goes whole or causal through the fused kernel, no boolean
    mask is kept (where a dense build held S^2), and the planner adds nothing for the document mask."""
    from orchestrator.planning.memory_model import document_mask_bytes

    monkeypatch.setattr(blocks, "ROW_TILE", 4)
    seq, batch = 48, 2
    for rank in range(cp):
        masks = blocks._BlockMasks(rank, cp, seq // cp, True, Documents(torch.zeros(batch, seq, dtype=torch.long)))
        assert all(not isinstance(mask, torch.Tensor) for src in range(cp) for _, _, mask in masks.tiles(src))
    for impl in ("ring", "ulysses", "allgather"):
        assert document_mask_bytes(seq, batch, cp, impl) == 0


@pytest.mark.parametrize("cp", [2, 4])
def test_fused_pieces_cover_the_causal_pairs_each_unmasked_or_square_causal(cp):
    """Every piece the fused kernel gets is whole (no mask) or causal over the same global positions (its own
    ``is_causal``), and together they let through exactly the causal pairs of each block."""
    seq = 4 * cp
    half = seq // cp // 2
    for rank in range(cp):
        for src in range(cp):
            q_pos, k_pos = zigzag_indices(seq, cp, rank), zigzag_indices(seq, cp, src)
            pairs = set()
            for rows, cols, causal in blocks._fused_pieces(rank, src, True, half):
                qs, ks = q_pos[rows].tolist(), k_pos[cols].tolist()
                if causal:
                    assert qs == ks, (rank, src, rows, cols)
                else:
                    assert min(qs) >= max(ks), (rank, src, rows, cols)
                pairs |= {(q, k) for q in qs for k in ks if q >= k}
            assert pairs == {(q, k) for q in q_pos.tolist() for k in k_pos.tolist() if q >= k}


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (6, 2)])
def test_fused_blocks_merged_by_lse_give_sdpa_and_its_gradients(hq, hkv):
    """Causal attention over keys cut in two blocks (an unmasked earlier one, a causal diagonal), each through the
    fused kernel and merged by the online softmax, equals SDPA; each block's backward, handed the merged output
    and lse, gives its exact share of SDPA's gradients (what the ring's backward sums)."""
    q, k, v, dout = _inputs(hq, hkv)
    rows, first, second = slice(8, 16), slice(0, 8), slice(8, 16)
    dout[:, :, first] = 0  # only rows 8-15 are this "rank's" queries: SDPA's gradients from those rows alone
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=hq != hkv)
    expected.backward(dout)
    state, scale = blocks._State(q[:, :, rows], hkv), q.shape[-1] ** -0.5
    for cols, causal in ((first, False), (second, True)):
        state.merge(slice(None), *blocks._kernel_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal, scale))
    out, lse = state.result()
    assert (out - expected[:, :, rows]).abs().max() < TOL
    dq, dk, dv = torch.zeros_like(q[:, :, rows]), torch.zeros_like(k), torch.zeros_like(v)
    for cols, causal in ((first, False), (second, True)):
        bq, bk, bv = blocks._kernel_backward(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols], out, lse,
                                          causal, scale)
        dq += bq
        dk[:, :, cols] += bk
        dv[:, :, cols] += bv
    for got, want in ((dq, ref[0].grad[:, :, rows]), (dk, ref[1].grad), (dv, ref[2].grad)):
        assert (got - want).abs().max() < TOL


def _inputs(hq: int, hkv: int):
    """q, k, v and dout of 16 tokens (seeded)."""
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    return (torch.randn(2, h, 16, 8, generator=gen) for h in (hq, hkv, hkv, hq))


@pytest.mark.parametrize("window", [1, 3, 8, 40])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (6, 2)])
@pytest.mark.parametrize("documents", [False, True])
def test_blockwise_attention_on_one_process_equals_sdpa_with_the_dense_mask(window, hq, hkv, documents, monkeypatch):
    """The single-process sliding window (what tp and cp=1 run) equals SDPA under the dense window mask, output
    and gradients, with windows shorter than a tile, across tiles, and longer than the sequence."""
    monkeypatch.setattr(blocks, "ROW_TILE", 4)
    gen = torch.Generator().manual_seed(window)
    q, k, v, dout = (torch.randn(2, h, 24, 8, generator=gen) for h in (hq, hkv, hkv, hq))
    pos = torch.arange(24)
    mask, docs = blocks.window_mask(pos, pos, window), None
    if documents:
        ids = document_layout(24, DOCUMENTS["split documents"])
        mask, docs = mask & document_mask(ids, pos, pos), Documents(ids)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*ref, attn_mask=mask, enable_gqa=hq != hkv).backward(dout)
    got = [t.clone().requires_grad_() for t in (q, k, v)]
    out = blocks.blockwise_attention(*got, docs, window)
    out.backward(dout)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hq != hkv)
    assert (out - expected).abs().max() < TOL
    for mine, theirs in zip(got, ref):
        assert (mine.grad - theirs.grad).abs().max() < TOL


def test_window_tiles_keep_masks_only_where_the_window_edge_crosses(monkeypatch):
    """An 8-token window over 64 tokens in tiles of 8: tiles out of the window are dropped, the diagonal ones go
    to the fused kernel as causal, and only the tile just left of each diagonal one keeps a boolean mask (O(S x
    tile) bytes, not S^2)."""
    monkeypatch.setattr(blocks, "ROW_TILE", 8)
    tiles = blocks._BlockMasks(0, 1, 64, True, None, window=8).tiles(0)
    kinds = [(rows.start, cols.start, "mask" if isinstance(mask, torch.Tensor) else mask) for rows, cols, mask in tiles]
    assert [k for k in kinds if k[2] is True] == [(r, r, True) for r in range(0, 64, 8)]
    assert [k for k in kinds if k[2] == "mask"] == [(r, r - 8, "mask") for r in range(8, 64, 8)]
    assert len(kinds) == 15


def _counted_rank(rank: int, ports, results) -> None:
    """One of 2 cp ranks: the bytes ``CommBytes`` counts for each strategy's forward and backward."""
    from tests.support.parity_harness import gloo_dp_mesh
    from workers.diagnostics.comm_bytes import CommBytes
    from workers.parallel import context_parallel as cp

    group = gloo_dp_mesh(rank, ports, 2).get_group()
    counted = {}
    for name in ("ring_attention", "allgather_attention", "ulysses_attention"):
        q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
        mode = CommBytes({group.group_name: "cp"}, ("cp",))
        with mode:
            getattr(cp, name)(q, k, v, group).sum().backward()
        counted[name] = mode.take()["cp"]
    results.put((rank, counted))


def test_the_byte_counter_sees_the_collectives_inside_the_attention_operators():
    """The strategies are custom operators (``workers.model.attention_ops``); a dispatch mode is off while it
    handles one, so ``CommBytes`` runs them with itself on and still counts their sends: K/V are 512 bytes a rank
    (fp32 [2, 1, 2, 8, 4]). Ring: K/V once forward and once backward, dK/dV (fp32) once, to the other block's owner
(a rank's own block's stays with it): 3 x 512.
    All-gather: the gather (512) and the dK/dV all-to-all of both blocks (half of 1024). Ulysses: 8 all-to-alls
    of 256-byte tensors, half of each sent: 4 x 256."""
    from tests.support.parity_harness import rank_ports, spawn_ranks

    by_rank = spawn_ranks(_counted_rank, (rank_ports(1),), 2, timeout_s=120)
    expected = {"ring_attention": 1536, "allgather_attention": 1024, "ulysses_attention": 1024}
    assert by_rank == {0: expected, 1: expected}
