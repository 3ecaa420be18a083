"""Reserving the rank grid on a Ray cluster.

One STRICT_PACK placement group per node block (``Grid.node_block``): a tensor-parallel group and its
context-parallel peers, consecutive ranks. TP peers exchange activations and CP peers K/V blocks every layer, so
they share a node, as the planner's time model assumes (``time_model.step_time``: tp, then cp, inside a node);
pipeline and data-parallel neighbours (less traffic) may spread across nodes, but in one order: each block asks
Ray (a soft hint) for the node ``node_order.block_targets`` gives it, so consecutive blocks, a replica's
pipeline stages, share a node or sit on neighbouring ones in the ``raymesh.io/topology`` label's order. Each
rank's node is recorded in the run's layout (``RankInfo.node_id`` in the summary's ``layout.ranks``), and the
order in ``layout.node_order``.

A grid the cluster's nodes could never hold, even idle, is refused at once, naming the nodes' sizes; one that
fits but finds the room taken waits (``event=placement_waiting`` names what holds it) and, if it is still not
placed when the wait ends, says the same: which placement groups and actors hold the CPUs/GPUs on which node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.errors import NO_VALUE, SpecError
from orchestrator.events import event
from orchestrator.planning.snapshot_memory import check_nodes, host_bytes_per_rank
from orchestrator.recovery.drain import live_nodes
from orchestrator.runtime.node_order import OrderedNode, fill_order, ordered_nodes, ordered_targets
from orchestrator.spec import JobSpec
from orchestrator.units import human_bytes
from workers.contract.grid import Grid

NOTICE_S = 5.0  # a reservation not placed after this long is said to be waiting, with what holds the room
LISTED = 8  # holders named in a message, the rest counted


def node_groups(grid: Grid) -> int:
    """Placement groups a grid reserves: one per node block (tp x cp peers, consecutive ranks)."""
    return grid.world_size // grid.node_block


@dataclass
class RankPlacement:
    """The reserved placement groups, one per node block (``block`` = tp x cp ranks), in rank order, and the
    live nodes in the topology order they were filled in (``node_order``)."""

    groups: list[PlacementGroup]
    block: int
    order: list[OrderedNode] = field(default_factory=list)

    def bundle(self, rank: int) -> tuple[int, int]:
        """``(group, bundle index)`` holding ``rank``: a block's peers are consecutive ranks packed in one group."""
        return rank // self.block, rank % self.block

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        group, index = self.bundle(rank)
        return PlacementGroupSchedulingStrategy(placement_group=self.groups[group], placement_group_bundle_index=index)

    def nodes(self, ranks=None) -> dict[int, str]:
        """rank -> the node its bundle is placed on now (``ranks``: those only; one look-up per placement group)."""
        ranks = range(len(self.groups) * self.block) if ranks is None else ranks
        tables: dict[int, dict] = {}
        out = {}
        for rank in ranks:
            group, index = self.bundle(rank)
            if group not in tables:
                tables[group] = placement_group_table(self.groups[group])["bundles_to_node_id"]
            out[rank] = tables[group][index]
        return out

    def move_off(self, nodes: set[str]) -> list[int]:
        """Reserve again, elsewhere, every group placed on one of ``nodes`` (being drained): the old group is
        removed and a new one with the same bundles asked for, which Ray places on a node it is not draining (or
        leaves pending until there is room: the replacements' ``placement_timeout_s`` then shrinks the grid).
        Returns the indices of the groups moved. Their actors must be gone already: removing a group kills them."""
        moved = []
        for g, pg in enumerate(self.groups):
            table = placement_group_table(pg)
            if set(table["bundles_to_node_id"].values()) & nodes:
                bundles = [dict(bundle) for bundle in pg.bundle_specs]  # read before the group is gone
                remove_placement_group(pg)
                self.groups[g] = placement_group(bundles, strategy="STRICT_PACK", name=table["name"])
                moved.append(g)
        return moved

    def release(self) -> None:
        for pg in self.groups:
            remove_placement_group(pg)


def rank_bundle(spec: JobSpec, use_gpu: bool) -> dict:
    """One rank's resources: its CPUs, its GPU, and the host memory its in-memory snapshots will hold (so Ray puts
    no more ranks on a node than its memory keeps: ``orchestrator.planning.snapshot_memory``)."""
    bundle = {"CPU": spec.parallel.cpus_per_rank}
    if use_gpu:
        bundle["GPU"] = 1
    snapshots = host_bytes_per_rank(spec)
    if snapshots:
        bundle["memory"] = snapshots
    return bundle


def can_reserve(spec: JobSpec, use_gpu: bool, groups: int, timeout_s: float) -> bool:
    """Whether ``groups`` more node blocks of ``spec`` could be placed now (reserved, then given back at once)."""
    bundle, block = rank_bundle(spec, use_gpu), spec.parallel.grid.node_block
    probe = [placement_group([bundle] * block, strategy="STRICT_PACK") for _ in range(groups)]
    try:
        return all(pg.wait(timeout_s) for pg in probe)
    finally:
        RankPlacement(groups=probe, block=block).release()


def reserve(spec: JobSpec, use_gpu: bool, timeout_s: float = 120.0) -> RankPlacement:
    """Reserve every rank's bundle: refused at once when the cluster's nodes could never hold the grid, else
    waited for up to ``timeout_s`` while other work holds the room, then refused naming what holds it."""
    nodes = live_nodes(ray.nodes())  # a node being drained takes no new rank
    check_nodes(spec, [node["Resources"].get("memory", 0.0) for node in nodes])
    block, n_groups = spec.parallel.grid.node_block, node_groups(spec.parallel.grid)
    bundle = rank_bundle(spec, use_gpu)
    check_fits(spec, bundle, [node["Resources"] for node in nodes])
    order = ordered_nodes(nodes)
    targets = _targets(order, bundle, block, spec.parallel.grid)
    groups = [
        placement_group([bundle] * block, strategy="STRICT_PACK", name=f"{spec.name}-tp{g}",
                        _soft_target_node_id=target)
        for g, target in enumerate(targets)
    ]
    placement = RankPlacement(groups=groups, block=block, order=order)
    what = f"{n_groups} group(s) of {block} x {_resources(bundle)} (tensor- and context-parallel peers share a node)"
    try:
        _wait_placed(groups, timeout_s, what)
    except ray.exceptions.GetTimeoutError:
        held = holders(groups)
        placement.release()
        raise SpecError(
            None, NO_VALUE,
            f"could not place {what} within {timeout_s:.0f}s: the nodes are large enough, but the room is "
            f"taken ({held})",
            "wait until that work ends or end it (`raymesh stop ID` for another raymesh job; `ray list "
            "placement-groups` and `ray list actors` show the rest), or lower parallel.dp/pp to what is free",
            where="Ray cluster") from None
    return placement


def _targets(order: list[OrderedNode], bundle: dict, block: int, grid) -> list[str | None]:
    """Each block's node ID in rank order (``node_order.block_targets`` over each node's free room now, the
    blocks filled in ``node_order.fill_order``: an expert group's blocks together)."""
    from ray._private.state import available_resources_per_node

    free = available_resources_per_node()
    room = [groups_on(free.get(node.node_id, {}), bundle, block) for node in order]
    fill = fill_order(grid.dp, grid.pp, grid.cp, grid.ep)
    return [None if t is None else order[t].node_id for t in ordered_targets(fill, room)]


def _wait_placed(groups: list[PlacementGroup], timeout_s: float, what: str) -> None:
    """Wait for every group; one still waiting after ``NOTICE_S`` is said (with what holds the room) before
    the rest of the wait. ``GetTimeoutError`` when ``timeout_s`` runs out."""
    ready = [pg.ready() for pg in groups]
    try:
        ray.get(ready, timeout=min(NOTICE_S, timeout_s))
        return
    except ray.exceptions.GetTimeoutError:
        if timeout_s <= NOTICE_S:
            raise
    event("placement_waiting", needs=what, up_to_s=f"{timeout_s:.0f}", held=holders(groups))
    ray.get(ready, timeout=timeout_s - NOTICE_S)


def check_fits(spec: JobSpec, bundle: dict, node_totals: list[dict]) -> None:
    """Refuse a grid the cluster's nodes could not hold even with nothing else running (``node_totals``: each
    live node's total resources): waiting would never place it."""
    p, needed, block = spec.parallel, node_groups(spec.parallel.grid), spec.parallel.grid.node_block
    fits = [groups_on(total, bundle, block) for total in node_totals]
    if sum(fits) >= needed:
        return
    group = _resources({key: amount * block for key, amount in bundle.items()})
    nodes = "; ".join(f"{_resources(total)} ({n} group(s))" for total, n in zip(node_totals, fits, strict=True))
    field, peers = ("parallel.tp", "tensor-parallel") if p.cp == 1 else ("parallel.tp*cp",
                                                                          "tensor- and context-parallel")
    if max(fits, default=0) == 0:
        raise SpecError(
            field, block,
            f"puts {block} ranks on one node ({group}: {peers} peers must share a node), but no node of "
            f"the Ray cluster has that much, even idle (nodes: {nodes or 'none alive'})",
            f"lower {field} (or parallel.cpus_per_rank) to what one node holds, or add a node that large")
    raise SpecError(
        "parallel.dp*pp*tp", p.grid.world_size,
        f"needs {needed} {peers} groups of {block} ranks ({group} each, on one node), but the Ray "
        f"cluster's nodes hold {sum(fits)} even idle (nodes: {nodes})",
        f"lower parallel.dp/pp so {'dp*pp*tp' if p.cp == 1 else 'dp*pp*cp*tp'} <= {sum(fits) * block}, or add nodes")


def groups_on(total: dict, bundle: dict, block: int) -> int:
    """Node blocks (``block`` bundles packed on the node) a node of ``total`` resources holds idle."""
    return min((math.floor(total.get(key, 0.0) / (amount * block) + 1e-9) for key, amount in bundle.items() if amount),
               default=0)


def holders(own: list[PlacementGroup]) -> str:
    """What takes the room on each live node: its free and total CPUs/GPUs, the placement groups placed there
    (other than ``own``) and the actors outside placement groups holding CPUs or GPUs."""
    from ray._private.state import available_resources_per_node

    free = available_resources_per_node()
    nodes = "; ".join(_node(node, free.get(node["NodeID"], {})) for node in ray.nodes() if node["Alive"])
    mine = {pg.id.hex() for pg in own}
    groups = [_placed(pg) for pg in ray.util.placement_group_table().values()
              if pg["state"] == "CREATED" and pg["placement_group_id"] not in mine]
    placed_own = sum(ray.util.placement_group_table(pg)["state"] == "CREATED" for pg in own)
    return (f"nodes: {nodes}; placement groups holding room: {_listed(groups)}; actors outside placement groups "
            f"holding CPUs/GPUs: {_actors()}; this job's own groups placed so far: {placed_own} of {len(own)} "
            "(their room counts as taken above)")


def _placed(pg: dict) -> str:
    """One placement group from ``placement_group_table``: its name (or id), what it reserves, on which nodes."""
    total: dict[str, float] = {}
    for bundle in pg["bundles"].values():
        for key, amount in bundle.items():
            total[key] = total.get(key, 0.0) + amount
    nodes = ",".join(sorted({node[:8] for node in pg["bundles_to_node_id"].values()}))
    return f"{pg['name'] or pg['placement_group_id'][:12]!r} ({_resources(total)} on {nodes})"


def _actors() -> str:
    """The live actors that hold CPUs or GPUs of their own (outside any placement group), from Ray's state API
    (served by the dashboard: a cluster without one cannot tell)."""
    try:
        from ray.util.state import list_actors

        actors = list_actors(filters=[("state", "=", "ALIVE")], detail=True, limit=10_000, timeout=10,
                             raise_on_missing_output=False)
    except Exception as exc:  # no dashboard (``include_dashboard=False``), or it did not answer
        return f"unknown (Ray's state API did not answer: {type(exc).__name__})"
    holding = [a for a in actors if not a.placement_group_id
               and any((a.required_resources or {}).get(key, 0) for key in ("CPU", "GPU"))]
    return _listed([f"{a.class_name} {a.name or a.actor_id[:12]} pid {a.pid} ({_resources(a.required_resources)} "
                    f"on {(a.node_id or '?')[:8]})" for a in holding])


def _listed(items: list[str]) -> str:
    if not items:
        return "none"
    more = f" and {len(items) - LISTED} more" if len(items) > LISTED else ""
    return ", ".join(items[:LISTED]) + more


def _resources(amounts: dict) -> str:
    """CPUs, GPUs and memory of a bundle or node, as people read them."""
    shown = [f"{amounts[key]:g} {key}" for key in ("CPU", "GPU") if amounts.get(key)]
    if amounts.get("memory"):
        shown.append(f"{human_bytes(amounts['memory'])} memory")
    return ", ".join(shown) or "nothing"


def _node(node: dict, free: dict) -> str:
    """A node (``ray.nodes()``'s entry): its address, id, and free and total CPUs and GPUs."""
    total = node["Resources"]
    room = ", ".join(f"{free.get(key, 0.0):g} of {total[key]:g} {key} free" for key in ("CPU", "GPU")
                     if total.get(key)) or "no CPU or GPU"
    return f"{node['NodeManagerAddress']} ({node['NodeID'][:8]}): {room}"
