"""Saved activations: offload to the store is exact; bf16/fp8 compression is close and still trains."""

from __future__ import annotations

import pytest
import torch

from tests.support.models import SMALL_MODEL, random_batch
from workers.model.documents import Documents, attending
from workers.model.gpt import GPT, lm_loss
from workers.model.registry import model_config
from workers.offload.activations import SavedActivations
from workers.offload.store import OffloadStore


def _loss_and_grads(model, policy: SavedActivations, seed: int = 0, documents: Documents | None = None):
    x, y = random_batch(seed)
    with policy.hooks(), attending([model], documents):
        loss = lm_loss(model(x), y)
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def _model():
    torch.manual_seed(0)
    return GPT(model_config(SMALL_MODEL))


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_offload_is_exact_and_leaves_nothing_behind(tier, tmp_path):
    model = _model()
    ref_loss, ref_grads = _loss_and_grads(model, SavedActivations())
    policy = SavedActivations(store=OffloadStore(tier, str(tmp_path), prefetch=2))
    loss, grads = _loss_and_grads(model, policy)
    assert loss == ref_loss
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert policy.peak_bytes > 4 * 32 * 64 * 4 * 2 * SMALL_MODEL["n_layers"]  # several activations per layer went out
    assert policy.held_bytes == 0 and policy.store.nbytes == 0
    assert not any(tmp_path.rglob("*.bin"))


@pytest.mark.parametrize("compression, bound", [("bf16", 0.01), ("fp8", 0.1)])
def test_compression_error_is_bounded(compression, bound, tmp_path):
    model = _model()
    ref_loss, ref_grads = _loss_and_grads(model, SavedActivations())
    for store in (None, OffloadStore("nvme", str(tmp_path))):
        loss, grads = _loss_and_grads(model, SavedActivations(compression, store))
        assert loss == ref_loss  # forward is untouched: only what backward reads is rounded
        flat, ref = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref_grads])
        error = float((flat - ref).norm() / ref.norm())
        assert 0 < error < bound, error


@pytest.mark.parametrize("compression", ["bf16", "fp8"])
def test_weights_saved_as_views_are_neither_rounded_nor_moved(compression, tmp_path):
    """``Linear`` saves ``weight.t()`` (a view, not the Parameter) for the input's gradient: that gradient is
    exact under compression, and offload moves only the input it saved, not the weight."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64, bias=False)
    x = torch.randn(32, 64)
    grads = {}
    for name, policy in (("exact", SavedActivations()),
                         ("compressed", SavedActivations(compression, OffloadStore("cpu", str(tmp_path))))):
        inp = x.clone().requires_grad_()
        with policy.hooks():
            layer(inp).sum().backward()
        grads[name] = inp.grad
    assert torch.equal(grads["compressed"], grads["exact"])
    assert policy.peak_bytes == x.numel() * {"bf16": 2, "fp8": 1}[compression]  # the input alone went out


def test_fp8_compressed_training_converges_like_uncompressed():
    losses = {}
    for compression in ("none", "fp8"):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        policy = SavedActivations(compression)
        run = []
        for step in range(16):
            loss, grads = _loss_and_grads(model, policy, seed=step % 2)
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            opt.step()
            opt.zero_grad()
            run.append(loss)
        losses[compression] = run
    tail = {k: sum(v[-4:]) / 4 for k, v in losses.items()}
    assert tail["fp8"] < 0.7 * losses["fp8"][0]
    assert abs(tail["fp8"] - tail["none"]) < 0.15 * tail["none"]


@pytest.mark.parametrize("compression", ["none", "bf16", "fp8"])
def test_the_shared_document_mask_is_neither_rounded_nor_moved(compression, tmp_path):
    """``model.attention_mask: document``: every block saves the one additive mask (0 where attended, -inf
    elsewhere). fp8 has no infinity, so a compressed mask came back NaN and every gradient with it; offloaded, each
    block moved its own copy. Kept as it is, the store holds what it holds for causal attention."""
    torch.manual_seed(0)
    model = GPT(model_config({**SMALL_MODEL, "positions": "rotary"}))
    four_documents = Documents((torch.arange(32) // 8).expand(4, -1))
    exact = _loss_and_grads(model, SavedActivations(), documents=four_documents)[1]
    held = {}
    for documents in (None, four_documents):
        policy = SavedActivations(compression, OffloadStore("cpu", str(tmp_path)))
        grads = _loss_and_grads(model, policy, documents=documents)[1]
        held[documents is None] = policy.peak_bytes
    flat, ref = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in exact])
    assert float((flat - ref).norm() / ref.norm()) < {"none": 0, "bf16": 0.01, "fp8": 0.1}[compression] + 1e-12
    assert held[False] == held[True]
