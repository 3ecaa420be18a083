"""Placement and elastic resizing counted from the Grid: TP groups, bundles, resized specs (no Ray cluster)."""

from __future__ import annotations

import pytest

from orchestrator import JobSpec
from orchestrator.errors import SpecError
from orchestrator.recovery.elastic import node_groups_per_replica, resized
from orchestrator.runtime.placement import RankPlacement, check_fits, groups_on, node_groups
from workers.contract.grid import Grid


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
    (Grid(dp=2, pp=2, cp=2, tp=2), 4, 2),  # a tp group and its cp peers: one block of 4 on one node
])
def test_node_groups(grid: Grid, groups: int, per_replica: int) -> None:
    assert node_groups(grid) == groups
    assert node_groups_per_replica(grid) == per_replica
    assert node_groups_per_replica(grid) * grid.dp == node_groups(grid)


def test_bundle_packs_tp_peers_in_one_group() -> None:
    grid = Grid(dp=2, pp=2, tp=2)
    placement = RankPlacement(groups=[], block=grid.node_block)
    bundles = [placement.bundle(r) for r in grid.ranks()]
    assert bundles == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    for rank in grid.ranks():  # a group's ranks differ only in their tp coordinate
        c = grid.coords(rank)
        assert placement.bundle(rank)[0] == placement.bundle(grid.rank_of(dp=c.dp, pp=c.pp, tp=0))[0]


def test_a_block_packs_tp_and_cp_peers_in_one_group() -> None:
    """Every tp group and every cp group lies inside one placement group (one node): the planner's order."""
    grid = Grid(dp=2, pp=2, cp=2, tp=2)
    placement = RankPlacement(groups=[], block=grid.node_block)
    for rank in grid.ranks():
        c = grid.coords(rank)
        peers = [grid.rank_of(dp=c.dp, pp=c.pp, cp=cp, tp=tp) for cp in range(grid.cp) for tp in range(grid.tp)]
        assert {placement.bundle(peer)[0] for peer in peers} == {placement.bundle(rank)[0]}
    assert len({placement.bundle(r)[0] for r in grid.ranks()}) == 4


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


def test_a_tensor_parallel_group_no_node_holds_is_refused_at_once_naming_the_nodes() -> None:
    """Two 2-CPU nodes hold 4 CPUs in all (what ``check_resources`` counts), but tp=4 packs 4 ranks on one node:
    no wait would ever place it."""
    spec = job(1, 1, 4)
    with pytest.raises(SpecError) as info:
        check_fits(spec, {"CPU": 1.0}, [{"CPU": 2.0}, {"CPU": 2.0, "GPU": 0.0}])
    assert info.value.field == "parallel.tp" and info.value.value == 4
    assert "(4 CPU: tensor-parallel" in info.value.problem
    assert "even idle (nodes: 2 CPU (0 group(s)); 2 CPU (0 group(s)))" in info.value.problem
    assert "lower parallel.tp" in info.value.fix


def test_more_groups_than_the_nodes_hold_idle_is_refused_with_the_largest_grid_that_fits() -> None:
    spec = job(6, 1, 2, train={"global_batch_size": 12, "microbatches": 1})  # 6 groups of 2 x 1 CPU, 1 GPU
    nodes = [{"CPU": 8.0, "GPU": 4.0}, {"CPU": 2.0, "GPU": 2.0}, {"CPU": 16.0}]  # 2 + 1 + 0 groups
    with pytest.raises(SpecError) as info:
        check_fits(spec, {"CPU": 1.0, "GPU": 1.0}, nodes)
    assert info.value.field == "parallel.dp*pp*tp" and "hold 3 even idle" in info.value.problem
    assert "dp*pp*tp <= 6" in info.value.fix
    check_fits(job(3, 1, 2, train={"global_batch_size": 12, "microbatches": 1}), {"CPU": 1.0, "GPU": 1.0}, nodes)


def test_groups_on_a_node_count_every_resource_of_the_bundle() -> None:
    assert groups_on({"CPU": 8.0, "memory": 10e9}, {"CPU": 1.0, "memory": 3e9}, 2) == 1  # memory: 10 GB // 6 GB
    assert groups_on({"CPU": 3.0}, {"CPU": 1.5}, 2) == 1  # exact fits are not lost to rounding
    assert groups_on({"CPU": 0.3 * 10}, {"CPU": 0.3}, 10) == 1
