"""NF4 (QLoRA's 4-bit NormalFloat) quantization: code book, error bound, storage, frozen Linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workers.model.nf4 import BLOCK, CODE_BOOK, SCALE_BLOCK, NF4Linear, quantize

# a few of the 16 values printed in the QLoRA paper's appendix / bitsandbytes' NF4 table
PUBLISHED = {0: -1.0, 1: -0.6961928009986877, 6: -0.09105003625154495, 7: 0.0, 8: 0.07958029955625534,
             14: 0.7229568362236023, 15: 1.0}


def test_code_book_is_the_nf4_table():
    assert CODE_BOOK.shape == (16,) and torch.all(CODE_BOOK[1:] > CODE_BOOK[:-1])
    for i, value in PUBLISHED.items():
        assert float(CODE_BOOK[i]) == pytest.approx(value, abs=1e-6)


def nf4_error_bound(weight: torch.Tensor, q) -> torch.Tensor:
    """Per-element worst case, derived from the code book and the block scales.

    The code is the nearest value to w/c (c = the block's absmax), so
    |w - c*code| <= c * gap/2, gap being the distance between the two code book
    values around w/c; double quantization then replaces c by c' with
    |c - c'| <= step/2 (round to nearest), which moves the value by at most
    |c - c'| * |code| <= step/2.
    """
    blocks = weight.reshape(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    x = blocks / absmax[:, None]
    upper = torch.searchsorted(CODE_BOOK, x.contiguous()).clamp(1, 15)
    half_gap = (CODE_BOOK[upper] - CODE_BOOK[upper - 1]) / 2
    step = q.scale_step.repeat_interleave(SCALE_BLOCK)[: absmax.numel()]
    bound = absmax[:, None] * half_gap + step[:, None] / 2
    return bound.reshape(weight.shape) * (1 + 1e-5) + 1e-9  # float32 rounding of the products


@pytest.mark.parametrize("dist", ["normal", "student_t"])
def test_dequantized_weights_are_within_nf4_error_of_the_originals(dist):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 320, generator=g) * 0.02
    if dist == "student_t":  # heavy tails: a few large weights per block set the absmax
        w = w / torch.rand(512, 320, generator=g).clamp_min(0.05).sqrt()
    q = quantize(w)
    err = (q.dequantize() - w).abs()
    bound = nf4_error_bound(w, q)
    assert torch.all(err <= bound), float((err / bound).max())
    # the bound is not loose: some element comes close to it, and the typical error is a fraction of it
    assert float((err / bound).max()) > 0.5
    assert float(err.mean()) < 0.5 * float(bound.mean())


def test_storage_is_half_a_byte_per_parameter_plus_double_quantized_scales():
    w = torch.randn(256, 1024)
    q = quantize(w)
    n, blocks = w.numel(), w.numel() // BLOCK
    expected = n // 2 + blocks + 4 * (blocks // SCALE_BLOCK) + 4  # codes, int8 scales, fp32 steps, fp32 offset
    assert q.nbytes() == expected
    assert q.nbytes() / n == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256), abs=1e-4)  # 0.516 B = 4.127 bit/param


def test_non_multiple_of_the_block_size_is_refused():
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize(torch.randn(3, 7))


def test_nf4_linear_matches_its_dequantized_weight_and_trains_nothing():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=False)
    frozen = NF4Linear(linear)
    assert list(frozen.parameters()) == [] and frozen.state_dict() == {}  # rebuilt from the base, never saved
    w = frozen.weight_nf4().dequantize()
    x = torch.randn(4, 64, requires_grad=True)
    y = frozen(x)
    assert torch.equal(y, F.linear(x, w))
    y.square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    F.linear(x2, w).square().sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-6)


@pytest.mark.parametrize("shape, dim, count", [((512, 96), 0, 2), ((256, 256), 1, 2), ((96, 512), 1, 4)])
def test_tensor_parallel_shards_dequantize_to_the_whole_weights_slices(shape, dim, count):
    """Quantize whole, then shard blocks: each rank gets bit-for-bit the single-process values (scale groups of
    256 blocks span shards, so the shards share the whole weight's double-quantization steps)."""
    torch.manual_seed(0)
    q = quantize(torch.randn(shape))
    whole = q.dequantize()
    pieces = [q.shard(dim, i, count) for i in range(count)]
    assert torch.equal(torch.cat([p.dequantize() for p in pieces], dim=dim), whole)
    assert sum(p.codes.numel() + p.scale_codes.numel() for p in pieces) == q.codes.numel() + q.scale_codes.numel()


def test_shards_that_would_split_a_block_are_refused():
    q = quantize(torch.randn(32, 32))  # blocks of 64 span two rows: a column split cuts every block
    with pytest.raises(ValueError, match="column shards"):
        q.shard(1, 0, 2)
