"""Pipeline stages on the nearest nodes (``orchestrator/runtime/node_order.py``, no Ray cluster): nodes ordered by
the ``raymesh.io/topology`` label, then IP, then ID; blocks filled in rank order, so a replica's stage s + 1
lands on stage s's node or the next one in that order."""

from __future__ import annotations

import itertools

import pytest

from orchestrator.runtime.node_order import (
    TOPOLOGY_LABEL,
    block_targets,
    fill_order,
    natural,
    ordered_nodes,
    ordered_targets,
)
from orchestrator.runtime.placement import RankPlacement
from workers.contract.grid import Grid


def _node(node_id: str, address: str, label: str | None = None, alive: bool = True) -> dict:
    return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": alive,
            "Labels": {TOPOLOGY_LABEL: label} if label is not None else {"ray.io/node-id": node_id}}


def test_nodes_follow_the_label_in_natural_order_then_the_ip_then_the_id():
    nodes = [_node("f", "10.0.0.9"), _node("e", "10.0.0.10"), _node("d", "10.0.0.1", "rack10.1"),
             _node("c", "10.0.0.2", "rack2.1"), _node("b", "10.0.0.3", "rack2.1"), _node("a", "10.0.0.10"),
             _node("x", "10.0.0.1", "rack1", alive=False)]
    # labelled first (rack2 before rack10; a tie by IP), then by IP numerically (.9 before .10), then by ID
    assert [n.node_id for n in ordered_nodes(nodes)] == ["c", "b", "d", "f", "a", "e"]
    assert natural("rack2.node10") < natural("rack10.node2") and natural("a9") < natural("a10")


@pytest.mark.parametrize("n_blocks, room, targets", [
    (4, [2, 2, 2], [0, 0, 1, 1]),
    (5, [1, 0, 3, 4], [0, 2, 2, 2, 3]),  # a node with no room is passed over
    (3, [1, 1], [0, 1, None]),  # beyond the room: Ray places it where it can
])
def test_blocks_fill_each_node_in_order(n_blocks, room, targets):
    assert block_targets(n_blocks, room) == targets


def test_consecutive_pipeline_stages_land_on_the_same_or_the_next_node():
    """dp=2 x pp=4 x tp=2 on three nodes holding 3 blocks each: every replica's stage s and s + 1 on one node or
    on neighbours, the blocks in rank order."""
    grid = Grid(dp=2, pp=4, tp=2)
    placement = RankPlacement(groups=[], block=grid.node_block)
    targets = block_targets(grid.world_size // grid.node_block, [3, 3, 3])
    node_of = {r: targets[placement.bundle(r)[0]] for r in grid.ranks()}
    for dp in range(grid.dp):
        stages = [node_of[grid.rank_of(dp=dp, pp=s)] for s in range(grid.pp)]
        assert all(b - a in (0, 1) for a, b in itertools.pairwise(stages)), stages
    assert [node_of[grid.rank_of(dp=d, pp=s)] for d in range(2) for s in range(4)] == [0, 0, 0, 1, 1, 1, 2, 2]


@pytest.mark.parametrize("grid, room", [
    (Grid(dp=4, pp=2, ep=4), [4, 4]),  # one expert group of 4 per stage: each stage's group fills one node
    (Grid(dp=4, pp=2, ep=2, tp=2), [2, 2, 2, 2]),  # two groups of 2 blocks per stage
    (Grid(dp=4, pp=1, cp=2, ep=4), [2, 2]),  # a group spans 2 blocks of 2 cp ranks
])
def test_each_expert_group_fills_one_node_and_stages_stay_neighbours(grid, room):
    """Rank order would put dp 0 and 1's two stages on node 0 and split every expert group over two nodes."""
    placement = RankPlacement(groups=[], block=grid.node_block)
    targets = ordered_targets(fill_order(grid.dp, grid.pp, grid.cp, grid.ep), room)
    node_of = {r: targets[placement.bundle(r)[0]] for r in grid.ranks()}
    groups: dict[tuple, set] = {}
    for r in grid.ranks():
        c = grid.coords(r)
        groups.setdefault((c.pp, c.tp, (c.dp * grid.cp + c.cp) // grid.ep), set()).add(node_of[r])
    assert all(len(nodes) == 1 for nodes in groups.values()), groups
    for dp in range(grid.dp):
        stages = [node_of[grid.rank_of(dp=dp, pp=s)] for s in range(grid.pp)]
        assert all(b - a in (0, 1) for a, b in itertools.pairwise(stages)), stages


def test_without_expert_parallelism_blocks_fill_in_rank_order():
    assert fill_order(dp=3, pp=2, cp=2, ep=1) == list(range(6))
