"""The rank grid: coordinates round-trip, the order keeps TP peers adjacent, replica peers sit one replica on."""

from __future__ import annotations

import itertools

import pytest

from workers.contract.grid import Grid

SHAPES = [(1, 1, 1, 1), (2, 2, 1, 2), (2, 1, 2, 2), (4, 2, 1, 1), (1, 2, 2, 2), (3, 1, 1, 4)]


@pytest.mark.parametrize(("dp", "pp", "cp", "tp"), SHAPES)
def test_every_rank_has_unique_coordinates_that_map_back(dp, pp, cp, tp):
    grid = Grid(dp=dp, pp=pp, cp=cp, tp=tp)
    assert grid.world_size == dp * pp * cp * tp
    seen = set()
    for rank in grid.ranks():
        c = grid.coords(rank)
        assert grid.rank_of(dp=c.dp, pp=c.pp, cp=c.cp, tp=c.tp) == rank
        seen.add((c.dp, c.pp, c.cp, c.tp))
    assert seen == set(itertools.product(range(dp), range(pp), range(cp), range(tp)))


def test_tensor_peers_are_consecutive_then_context_then_pipeline_then_data():
    grid = Grid(dp=2, pp=2, cp=2, tp=2)
    assert [grid.coords(r).tp for r in range(4)] == [0, 1, 0, 1]
    assert [grid.coords(r).cp for r in range(0, 8, 2)] == [0, 1, 0, 1]
    assert [grid.coords(r).pp for r in range(0, 16, 4)] == [0, 1, 0, 1]
    assert [grid.coords(r).dp for r in range(0, 16, 8)] == [0, 1]


def test_without_context_parallelism_the_order_is_the_old_dp_pp_tp_one():
    grid = Grid(dp=2, pp=3, tp=2)
    for rank in grid.ranks():
        c = grid.coords(rank)
        assert (c.dp, c.pp, c.tp) == (rank // 6, (rank // 2) % 3, rank % 2)
        assert grid.coords_dict(rank) == {"dp": c.dp, "pp": c.pp, "tp": c.tp}
    assert grid.mesh_dims == ("dp", "pp", "tp") and grid.mesh_shape == (2, 3, 2)


def test_context_and_expert_axes_show_only_when_enabled():
    grid = Grid(dp=4, pp=1, cp=2, ep=2, tp=1)
    assert grid.mesh_dims == ("dp", "pp", "cp", "tp")
    assert grid.coords_dict(3) == {"dp": 1, "pp": 0, "tp": 0, "cp": 1, "ep": 1}
    assert grid.world_size == 8  # ep borrows data-parallel ranks
    assert (grid.cp_enabled, grid.ep_enabled, grid.pp_enabled) == (True, True, False)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dp": 0}, "Grid.dp=0"), ({"tp": 1.5}, "Grid.tp=1.5"), ({"dp": 3, "ep": 2}, r"ep=2 does not divide dp\*cp=3"),
])
def test_bad_degrees_are_refused_naming_the_axis(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Grid(**kwargs)


def test_replica_peer_is_the_same_position_in_the_next_replica():
    grid = Grid(dp=2, pp=2, tp=2)
    for rank in grid.ranks():
        peer = grid.replica_peer(rank)
        assert grid.position(peer) == grid.position(rank) and grid.coords(peer).dp != grid.coords(rank).dp
    assert Grid(pp=2, tp=2).replica_peer(3) == 0  # one replica: the next rank
    assert Grid().replica_peer(0) is None


def test_from_parallel_reads_mappings_and_objects_and_defaults_new_axes_to_one():
    class Section:
        dp, pp, tp = 2, 1, 2

    assert Grid.from_parallel({"dp": 2, "pp": 1, "tp": 2, "zero": 3}) == Grid(dp=2, tp=2)
    assert Grid.from_parallel(Section()) == Grid(dp=2, tp=2)
    assert Grid(dp=4, ep=4).with_dp(2) == Grid(dp=2)
    assert Grid(dp=2, pp=2, tp=2).describe() == "dp*pp*tp = 2*2*2"


@pytest.mark.parametrize(("dp", "pp", "cp", "ep", "tp"), [(2, 2, 2, 2, 1), (2, 1, 2, 4, 2), (1, 1, 2, 2, 1),
                                                            (4, 2, 1, 2, 2), (2, 1, 4, 8, 1)])
def test_expert_groups_are_carved_from_dp_times_cp_ranks_of_one_stage_and_tp_index(dp, pp, cp, ep, tp):
    """Every rank sits once in the expert mesh; an ep group's ranks share pp and tp and have ep distinct ep
    coordinates (cp peers first); an edp group's ranks hold the same experts; a replica peer holds the same state."""
    grid = Grid(dp=dp, pp=pp, cp=cp, ep=ep, tp=tp)
    ranks = grid.expert_mesh_ranks()
    flat = [r for g in ranks for e in g for p in e for r in p]
    assert sorted(flat) == list(range(grid.world_size))
    edp, _, stages, tps = grid.expert_mesh_shape
    for p in range(stages):
        for t in range(tps):
            for g in range(edp):
                group = [ranks[g][e][p][t] for e in range(ep)]
                coords = [grid.coords(r) for r in group]
                assert {(c.pp, c.tp) for c in coords} == {(p, t)} and sorted(c.ep for c in coords) == list(range(ep))
                if ep <= cp:  # the cp peers alone split the experts: one dp index
                    assert len({c.dp for c in coords}) == 1
            holders = [grid.coords(ranks[g][0][p][t]).ep for g in range(edp)]
            assert set(holders) == {0}
    for rank in grid.ranks():
        peer = grid.replica_peer(rank)
        if grid.dp > grid.expert_stride:
            assert peer != rank and grid.same_state(rank, peer)
