"""Which node each node block goes to: nodes in a topology order, consecutive blocks on the same or the next node.

Ray's placement groups know no distance between nodes, and the planner's time model assumes a pipeline's
neighbouring stages are near each other (``time_model.step_time``: pp is the next dimension out after tp and cp).
So raymesh defines a distance: nodes are put in one order, by

1. the Ray node label ``raymesh.io/topology`` (``ray start --labels='{"raymesh.io/topology": "rack03.07"}'``),
   compared in natural order (the digits as numbers: ``rack2`` before ``rack10``); nodes with it come first;
2. then the node's IP address (numerically), then its node ID,

and two nodes are neighbours when they are next to each other in that order. Blocks (``Grid.node_block``: tp x cp
consecutive ranks) come in rank order, pipeline stages of one data-parallel replica one after the other, so
filling each node in that order with as many blocks as its free room holds puts stage s + 1 on stage s's node or
on the next one (``block_targets``). The target is a soft hint to Ray (``_soft_target_node_id``, STRICT_PACK
only): a node that filled up meanwhile moves its block elsewhere rather than leaving the job waiting; the
summary records the order and each rank's node (``layout.node_order``, ``layout.ranks[].node_id``), so either
can be checked.

Under expert parallelism (``parallel.ep`` > 1) an expert group's ranks share a stage and differ in their data
(and cp) index, so rank order would scatter them over the nodes of every stage. ``fill_order`` then fills the
nodes stage by stage within a run of data indices that holds whole expert groups (and whole blocks): each expert
group's all-to-all stays in one node where the node has room for it, and a replica's next stage still lands on
the same or the next node.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass

TOPOLOGY_LABEL = "raymesh.io/topology"


@dataclass(frozen=True)
class OrderedNode:
    """One live node in topology order: its ID, its label (empty when unset) and its IP address."""

    node_id: str
    topology: str
    address: str

    def to_dict(self) -> dict:
        return {"node_id": self.node_id, "topology": self.topology, "address": self.address}


def natural(text: str) -> tuple:
    """``text`` as a key whose digit runs compare as numbers (``rack2`` < ``rack10``)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text) if part)


def _address(text: str) -> tuple:
    """An IP address as a key in numeric order (an unparsable one after the others, by its text)."""
    try:
        return 0, int(ipaddress.ip_address(text)), ""
    except ValueError:
        return 1, 0, text


def ordered_nodes(nodes: list[dict]) -> list[OrderedNode]:
    """The live ones of ``ray.nodes()``'s entries in topology order (module doc)."""
    out = [OrderedNode(n["NodeID"], (n.get("Labels") or {}).get(TOPOLOGY_LABEL, ""), n.get("NodeManagerAddress", ""))
           for n in nodes if n.get("Alive")]
    return sorted(out, key=lambda n: (not n.topology, natural(n.topology), _address(n.address), n.node_id))


def block_targets(n_blocks: int, room: list[int]) -> list[int | None]:
    """For each of ``n_blocks`` blocks in rank order, the index of the node (in topology order, ``room[i]``
    blocks free on node ``i``) it should go to: each node filled before the next, so consecutive blocks land on
    one node or on neighbours (nodes with no room are passed over and so are not counted as between them). Blocks
    beyond the room get None: Ray places them where it can."""
    targets: list[int | None] = []
    for node, free in enumerate(room):
        targets += [node] * min(max(free, 0), n_blocks - len(targets))
    return targets + [None] * (n_blocks - len(targets))


def fill_order(dp: int, pp: int, cp: int, ep: int) -> list[int]:
    """Block indices (rank order: block ``d * pp + s`` holds data index ``d`` at stage ``s``) in the order they
    fill the nodes: runs of ``lcm(ep, cp) / cp`` data indices (whole expert groups, whose ep index is
    ``(d * cp + c) % ep``, and whole blocks), in each run stage by stage, in each stage by data index. Without
    expert parallelism the run is one data index: rank order."""
    run = math.lcm(ep, cp) // cp
    return sorted(range(dp * pp), key=lambda b: (b // pp // run, b % pp, b // pp))


def ordered_targets(order: list[int], room: list[int]) -> list[int | None]:
    """``block_targets`` for the blocks filled in ``order``, given back in rank order (index: block)."""
    filled = block_targets(len(order), room)
    out: list[int | None] = [None] * len(order)
    for block, node in zip(order, filled, strict=True):
        out[block] = node
    return out
