"""Document masking (``model.attention_mask: document``) on one process: a packed window gives each token the
logits its document gives alone, and Llama's equal ``transformers``' on the same 4-D mask (eager attention, an
independent implementation). float32, CPU."""

from __future__ import annotations

import pytest
import torch

from tests.support.hf import hf_llama, raymesh_llama_from
from workers.data.loader import document_ids
from workers.model.config import ModelConfig
from workers.model.documents import Documents, attending
from workers.model.registry import build_model

EOS = 0
FAMILIES = {
    "gpt": {"arch": "gpt", "positions": "rotary"},
    "gpt-learned": {"arch": "gpt", "positions": "learned"},
    "llama": {"arch": "llama", "n_kv_heads": 2, "d_ff": 48},
}


def _packed(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, list[slice]]:
    """One window [1, sum(lengths)] of documents of ``lengths``, each after the first opened by ``EOS`` as
    ``prepare_data`` writes them, and each document's positions in it."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 256, (1, sum(lengths)), generator=gen)
    spans, start = [], 0
    for n in lengths:
        if start:
            tokens[0, start] = EOS
        spans.append(slice(start, start + n))
        start += n
    return tokens, spans


def _model(family: str):
    torch.manual_seed(0)
    cfg = ModelConfig(**FAMILIES[family], d_model=32, n_layers=2, n_heads=4, seq_len=32)
    return build_model(cfg).eval()


def test_document_ids_count_the_eos_and_it_opens_the_next_document():
    ids = document_ids(torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8]]), EOS)
    assert ids.tolist() == [[0, 0, 1, 1, 2, 3, 3]]


def test_learned_positions_restart_at_each_document_on_a_context_parallel_share():
    """A cp rank's tokens (the zigzag share of the window) look up their index within their document, as the
    whole window's do at those positions."""
    from workers.parallel.context_parallel import zigzag_indices

    ids = document_ids(torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9], [EOS, 1, 2, 3, 4, 5, EOS, 6]]), EOS)
    documents = Documents(ids)
    assert documents.positions(torch.arange(8)).tolist() == [[0, 1, 0, 1, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]]
    share = zigzag_indices(8, 2, 1)  # rank 1 of cp 2: positions 2, 3, 4, 5
    assert documents.positions(share).tolist() == [[0, 1, 0, 0], [2, 3, 4, 5]]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_packed_window_gives_each_document_its_own_logits(family):
    """Rotary positions are relative, and learned ones restart at each document (Megatron's
    ``--reset-position-ids``), so a document attending only to itself scores as it does alone, wherever it starts
    in the window; without the mask the later documents' logits change (they see the earlier ones)."""
    model = _model(family)
    tokens, spans = _packed([7, 1, 12, 9])
    with torch.no_grad():
        causal = model(tokens)
        with attending([model], Documents(document_ids(tokens, EOS))):
            masked = model(tokens)
        for span in spans:
            alone = model(tokens[:, span])
            torch.testing.assert_close(masked[:, span], alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(causal[:, spans[2]], masked[:, spans[2]], atol=1e-3)
    torch.testing.assert_close(model(tokens), causal)  # the cores are causal again after the block


def test_llama_equals_transformers_eager_attention_on_the_same_4d_mask():
    """``transformers``' LlamaModel takes a custom 4-D additive mask as it is; with eager attention (its own
    softmax over masked scores, not SDPA) it gives our document-masked logits, GQA and Llama-3 rotary on."""
    hf = hf_llama()
    hf.config._attn_implementation = "eager"
    ours = raymesh_llama_from(hf)
    tokens = torch.cat([_packed([5, 11, 1, 7])[0], _packed([20, 4], seed=1)[0]])
    ids = document_ids(tokens, EOS)
    seq = tokens.shape[1]
    allowed = ((ids[:, :, None] == ids[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril())[:, None]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        theirs = hf(tokens, attention_mask=additive).logits
        with attending([ours], Documents(ids)):
            mine = ours(tokens)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(mine, hf(tokens).logits, atol=1e-3)  # the mask matters on this window


def test_no_block_saves_a_dense_mask_and_the_tile_masks_go_with_the_microbatch():
    """Attention within documents runs blockwise (``blockwise_attention``): no block saves a ``[.., S, S]`` mask (the
    dense build saved one ``[batch, 1, S, S]`` mask per microbatch), the saved tensors are causal attention's, and
    the boundary tiles' boolean masks cached on the ``Documents`` are released when the microbatch's block ends."""
    model = _model("llama")
    tokens, _ = _packed([7, 1, 12, 9])
    seq = tokens.shape[1]
    documents = Documents(document_ids(tokens, EOS))
    saved, causal = [], []

    def keeper(into):
        return lambda t: into.append(t) or t

    with torch.autograd.graph.saved_tensors_hooks(keeper(causal), lambda t: t):
        model(tokens)
    with attending([model], documents), torch.autograd.graph.saved_tensors_hooks(keeper(saved), lambda t: t):
        loss = model(tokens).sum()
        assert documents._masks  # the boundary tiles' masks, built once for every layer
    assert not [t for t in saved if t.dim() >= 2 and t.shape[-2:] == (seq, seq)]
    assert sorted(t.numel() for t in saved) == sorted(t.numel() for t in causal)
    assert not documents._masks
    loss.backward()


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_every_query_sees_itself_on_the_sdpa_paths(cp):
    """The additive mask is -inf wherever a query may not look; a row of nothing but -inf would make SDPA's
    softmax NaN. Its own position is always allowed (same document, not later), under whole-window attention
    (plain, Ulysses) and all-gather CP's zigzag queries over rank-ordered keys alike, even for one-token documents
    and a window that opens with the end-of-document id."""
    from workers.model.documents import document_mask
    from workers.parallel.context_parallel import zigzag_indices

    seq = 32
    tokens = torch.tensor([[EOS, EOS, 3, EOS, EOS, EOS] + [4] * (seq - 6), [5] * (seq - 1) + [EOS]])
    ids = document_ids(tokens, EOS)
    keys = torch.cat([zigzag_indices(seq, cp, r) for r in range(cp)])
    for rank in range(cp):
        queries = zigzag_indices(seq, cp, rank)
        itself = queries[:, None] == keys[None, :]  # [queries, keys]: each query's own key
        allowed = document_mask(ids, queries, keys)
        assert allowed[:, 0][:, itself].all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_low_precision_masked_forward_and_backward_is_the_fp32_one_within_its_rounding(family, dtype):
    """Under autocast (``precision.dtype`` bf16, or fp16 with loss scaling) the additive mask is built in the
    compute dtype, -inf included: logits stay finite and within the dtype's rounding of the fp32 masked ones, and
    so do the gradients (an fp16 loss scale multiplies the loss, never the mask)."""
    model = _model(family)
    tokens, _ = _packed([7, 1, 12, 9, 3])
    ids = document_ids(tokens, EOS)
    out = {}
    for run_dtype in (torch.float32, dtype):
        with torch.autocast("cpu", dtype=dtype, enabled=run_dtype != torch.float32), \
                attending([model], Documents(ids)):
            logits = model(tokens)
            (logits.float().square().mean() * (1024.0 if dtype == torch.float16 else 1.0)).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        out[run_dtype] = logits.detach().float(), grads
    (ref, ref_grads), (low, low_grads) = out[torch.float32], out[dtype]
    assert low.isfinite().all() and low_grads.isfinite().all()
    tol = {torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    assert float((low - ref).norm() / ref.norm()) < tol
    assert float((low_grads - ref_grads).norm() / ref_grads.norm()) < 5 * tol
