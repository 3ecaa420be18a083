"""Placement and elastic resizing counted from the Grid: TP groups, bundles, resized specs (no Ray cluster)."""

from __future__ import annotations

import pytest

from orchestrator import JobSpec
from orchestrator.errors import SpecError
from orchestrator.recovery.elastic import resized
from orchestrator.runtime.placement import RankPlacement, tp_groups, tp_groups_per_replica
from workers.parallel.grid import Grid


def job(dp: int, pp: int, tp: int, **extra) -> JobSpec:
    return JobSpec.from_dict({"data": {"path": "data/tiny"}, "model": {"n_layers": 4},
                              "parallel": {"dp": dp, "pp": pp, "tp": tp},
                              "train": {"global_batch_size": 16, "microbatches": 4}, **extra})


def test_parallel_spec_grid_and_world_size() -> None:
    spec = job(2, 2, 2)
    assert spec.parallel.grid == Grid(dp=2, pp=2, tp=2)
    assert spec.parallel.world_size == 8


@pytest.mark.parametrize("grid, groups, per_replica", [
    (Grid(dp=2, pp=2, tp=2), 4, 2),
    (Grid(dp=4, pp=1, tp=2), 4, 1),
    (Grid(dp=1, pp=3, tp=1), 3, 3),
    (Grid(dp=2, pp=2, cp=2, tp=2), 8, 4),
])
def test_tp_groups(grid: Grid, groups: int, per_replica: int) -> None:
    assert tp_groups(grid) == groups
    assert tp_groups_per_replica(grid) == per_replica
    assert tp_groups_per_replica(grid) * grid.dp == tp_groups(grid)


def test_bundle_packs_tp_peers_in_one_group() -> None:
    grid = Grid(dp=2, pp=2, tp=2)
    placement = RankPlacement(groups=[], tp=grid.tp)
    bundles = [placement.bundle(r) for r in grid.ranks()]
    assert bundles == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    for rank in grid.ranks():  # a group's ranks differ only in their tp coordinate
        c = grid.coords(rank)
        assert placement.bundle(rank)[0] == placement.bundle(grid.rank_of(dp=c.dp, pp=c.pp, tp=0))[0]


def test_resized_keeps_global_batch_and_drops_faults_past_the_smaller_grid() -> None:
    spec = job(4, 2, 1, faults=[{"kind": "kill_rank", "rank": 1, "at_step": 2},
                                {"kind": "kill_rank", "rank": 6, "at_step": 3}])
    smaller = resized(spec, 2)
    assert smaller.parallel.grid == spec.parallel.grid.with_dp(2)
    assert (smaller.train.global_batch_size, smaller.train.microbatches) == (16, 8)
    assert [f.rank for f in smaller.faults] == [1]


def test_resized_refuses_a_dp_the_batch_cannot_split_over() -> None:
    with pytest.raises(SpecError):
        resized(job(4, 1, 1), 3)
