"""Expert dropout keyed by (seed, layer, expert, token stream position, hidden unit): layout-independent.

A batch split over ranks or microbatches must drop the same hidden units of the same token copies as the whole
batch in one process (``workers.model.moe.keyed_dropout``); the global RNG's ``F.dropout`` would not.
"""

from __future__ import annotations

import pytest
import torch

from workers.model import moe
from workers.model.config import ModelConfig

E, D, N, B = 4, 8, 12, 4  # experts, width, tokens per sequence, sequences


def test_keyed_dropout_follows_the_rows_keys_at_the_rate_asked():
    keys = moe.mix(5, torch.arange(4000))
    hidden = torch.ones(4000, 64)
    out = moe.keyed_dropout(hidden, keys, 0.25)
    assert out.unique().tolist() == pytest.approx([0.0, 1 / 0.75])
    assert (out == 0).float().mean().item() == pytest.approx(0.25, abs=0.01)
    order = torch.randperm(4000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(moe.keyed_dropout(hidden[order], keys[order], 0.25), out[order])  # row order is irrelevant
    assert not torch.equal(moe.keyed_dropout(hidden, moe.mix(6, torch.arange(4000)), 0.25), out)


def test_hash31_stays_in_31_bits_for_large_stream_positions():
    values = moe.mix(123, torch.tensor([0, 1, 2**31 - 1, 2**31, 2**40 + 7, 2**62]))
    assert torch.all((values >= 0) & (values < 2**31)) and len(set(values.tolist())) == 6


def _layer() -> moe.MoELayer:
    cfg = ModelConfig(d_model=D, d_ff=16, n_layers=1, n_heads=2,
                      moe={"experts": E, "router": "topk", "top_k": 2, "expert_dropout": 0.3})
    layer = moe.MoELayer(cfg, 0, swiglu=False)
    gen = torch.Generator().manual_seed(1)
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.3
    return layer.train()


def _forward(layer: moe.MoELayer, x: torch.Tensor, first_sequence: int) -> torch.Tensor:
    moe.begin_step([layer], seed=9, first_sequence=first_sequence, aux_scale=1.0)
    return layer(x)


def test_a_split_batch_drops_what_the_whole_batch_drops():
    layer, x = _layer(), torch.randn(B, N, D, generator=torch.Generator().manual_seed(2))
    whole = _forward(layer, x, 10)
    halves = torch.cat([_forward(layer, x[:2], 10), _forward(layer, x[2:], 12)])
    torch.testing.assert_close(halves, whole, rtol=0, atol=0)
    torch.manual_seed(0)  # the global RNG plays no part
    torch.testing.assert_close(_forward(layer, x, 10), whole, rtol=0, atol=0)
    assert not torch.allclose(_forward(layer, x, 14), whole)  # other stream positions, other masks
    layer.eval()
    assert not torch.allclose(_forward(layer, x, 10), whole)  # the dropout was on in training
