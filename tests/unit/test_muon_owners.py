"""``WholeMatrixMuon`` splits the Newton-Schulz work: on two spawned gloo ranks, each matrix is orthogonalised by one
rank only (each rank its share), and the matrices after three steps are PyTorch's Muon on one process, bit for bit:
FSDP2-like dim-0 shards (one uneven), TP-like dim-1 shards, and ZeRO-0's replicated plain tensors split by
broadcast or kept redundant. Which rank owns which matrix is checked without a group."""

from __future__ import annotations

import pytest
import torch

from tests.support import muon_ranks
from workers.optim.muon import WholeMatrixMuon, owners

SHAPES = [(24, 16), (16, 24), (24, 16), (16, 16), (40, 16), (13, 8)]  # 13 rows: dim-0 shards of 7 and 6
MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "ns_steps": 4, "adjust_lr_fn": "match_rms_adamw"}
STEPS = 3
CASES = {
    "fsdp2 dim-0 shards": {"layout": "sharded", "shard_dim": 0},
    "tp dim-1 shards": {"layout": "sharded", "shard_dim": 1, "shapes": SHAPES[:-1]},
    "zero-0 split": {"layout": "replicated", "split": True},
    "zero-0 redundant": {"layout": "replicated", "split": False},
}


@pytest.fixture(scope="module")
def ranks():
    cases = [{"shapes": SHAPES, "steps": STEPS, "muon": MUON, "optimizer": WholeMatrixMuon, **c}
             for c in CASES.values()]
    return muon_ranks.run(2, cases)


@pytest.mark.parametrize("index, name", list(enumerate(CASES)))
def test_two_ranks_step_pytorchs_muon_on_the_whole_matrices_bit_for_bit(ranks, index, name):
    shapes = CASES[name].get("shapes", SHAPES)
    expected = muon_ranks.reference(shapes, STEPS, **MUON)
    for rank in (0, 1):
        got = ranks[rank][index]["matrices"]
        for i, (g, e) in enumerate(zip(got, expected)):
            assert torch.equal(torch.from_numpy(g), e), (name, rank, i)


@pytest.mark.parametrize("index, name", [(i, n) for i, n in enumerate(CASES) if n != "zero-0 redundant"])
def test_each_matrix_is_orthogonalised_by_one_rank(ranks, index, name):
    per_rank = [ranks[r][index]["newton_schulz"] for r in (0, 1)]
    matrices = len(CASES[name].get("shapes", SHAPES))
    assert sum(per_rank) == STEPS * matrices, per_rank
    assert all(n > 0 for n in per_rank), per_rank


def test_without_splitting_every_rank_orthogonalises_every_matrix(ranks):
    index = list(CASES).index("zero-0 redundant")
    assert [ranks[r][index]["newton_schulz"] for r in (0, 1)] == [STEPS * len(SHAPES)] * 2


def test_owners_balance_newton_schulz_cost_not_count():
    """Two wide matrices and four small ones over two ranks: each rank gets one wide one, whatever their order."""
    params = [torch.zeros(s) for s in [(64, 256), (64, 64), (64, 64), (64, 256), (64, 64), (64, 64)]]
    group_of_two = type("Two", (), {})()
    by_id = owners(params, None)
    assert set(by_id.values()) == {0}  # no group: this rank owns all
    import workers.optim.muon as module

    real = module._group_size
    module._group_size = lambda key: 2 if key is group_of_two else real(key)
    try:
        split = owners(params, group_of_two)
    finally:
        module._group_size = real
    assert {split[id(params[0])], split[id(params[3])]} == {0, 1}
    assert sorted(split.values()) == [0, 0, 0, 1, 1, 1]
