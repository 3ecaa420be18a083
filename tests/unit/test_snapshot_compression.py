"""``fault_tolerance.snapshot_compression: zlib`` (seed 000 lines 444-447, lossless compression): a rank's
in-memory snapshot (and the replica it ships) kept as byte planes under DEFLATE. Checked: every tensor comes
back bit for bit (odd dtypes, NaN payloads, signed zeros, 0-d Adam steps), a trained run's snapshot measurably
shrinks, and rolling back to a compressed snapshot replays the uninterrupted steps exactly."""

from __future__ import annotations

import pytest
import torch

from tests.support.one_rank import one_rank_trainer
from workers.state import lossless


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("tensor", [
    torch.tensor([0.0, -0.0, float("nan"), float("inf"), 1e-45]),
    torch.randn(3, 5, dtype=torch.float64),
    torch.randn(7, 2).to(torch.bfloat16),
    torch.tensor(12.0),  # Adam's step counter: 0-d
    torch.arange(10, dtype=torch.int64),
    torch.empty(0, 4),
])
def test_a_tensor_comes_back_bit_for_bit(tensor):
    back = lossless.unpack_tensor(lossless.pack_tensor(tensor))
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(_bits(back), _bits(tensor))


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    with one_rank_trainer(tmp_path_factory, fault_tolerance={"snapshot_compression": "zlib"}) as t:
        yield t


def test_a_trained_snapshot_shrinks_and_rolls_back_exactly(trainer):
    from workers.state import snapshot

    assert trainer.spec.fault_tolerance.snapshot_compression == "zlib"
    for _ in range(2):
        trainer.train_step()
    plain, packed = snapshot.take(trainer.state), snapshot.take(trainer.state, compress=True)
    raw, kept = lossless.sizes(packed)
    assert raw == sum(t.numel() * t.element_size() for t in _tensors(plain)) and kept < 0.95 * raw
    unpacked = lossless.unpack(packed)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(_tensors(plain), _tensors(unpacked), strict=True))
    ahead = [trainer.train_step().loss for _ in range(2)]
    snapshot.restore(trainer.state, packed)
    assert [trainer.train_step().loss for _ in range(2)] == ahead


def _tensors(tree):
    return [v for v in lossless._leaves(tree) if torch.is_tensor(v)]
