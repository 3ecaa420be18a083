"""Meta-device init at start-up: a dp=4 ZeRO-3 rank's peak host memory is its shard plus one tensor, not the model.

Ranks are spawned processes over gloo (``tests.support.startup_memory``), no Ray. The model is ~145 MiB of
fp32 weights, each rank holds ~36 MiB; the old whole-model build rose by ~178 MiB per rank.
"""

from __future__ import annotations

import pytest

from tests.support.startup_memory import MiB, measure

# what a rank's RSS rises by building a near-weightless model (imports, DTensor/FSDP2 set-up): ~31 MiB here
FIXED_COST = 40 * MiB


@pytest.fixture(scope="module")
def ranks():
    return measure({"dp": 4, "zero": 3})


def test_each_rank_peaks_at_its_shard_plus_the_largest_tensor(ranks):
    for r in ranks:
        assert r.rise_bytes <= r.held_bytes + r.largest_bytes + FIXED_COST, r
        assert r.rise_bytes < r.full_bytes, r  # the whole model was never resident


def test_the_shards_are_a_quarter_of_the_model_each(ranks):
    assert len(ranks) == 4
    for r in ranks:
        assert r.held_bytes == pytest.approx(r.full_bytes / 4, rel=0.01), r
