"""Context-parallel attention (ring, Ulysses, all-gather) equals single-process SDPA on the whole sequence.

One spawn of cp gloo ranks per cp degree runs every case (module-scoped fixture); each test reads its case.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.cp_attention import HEADS, run_all
from workers.parallel.context_parallel import zigzag_indices

STRATEGIES = ("allgather",)
TOL = 1e-5


@pytest.fixture(scope="module", params=[2, 4], ids=lambda cp: f"cp{cp}")
def results(request):
    return request.param, run_all(request.param, STRATEGIES)


def test_zigzag_pairs_each_early_chunk_with_its_mirror():
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([zigzag_indices(24, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(24))


def test_zigzag_refuses_a_sequence_it_cannot_split_evenly():
    with pytest.raises(ValueError, match="seq_len=10 is not divisible by 2\\*cp=4"):
        zigzag_indices(10, 2, 0)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", [h[0] for h in HEADS])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_single_process_sdpa(results, strategy, heads, causal):
    _, by_case = results
    err = by_case[(strategy, heads, causal)]
    assert isinstance(err, float), err
    assert err < TOL, f"{strategy} {heads} causal={causal}: max |diff| {err:.3g}"
