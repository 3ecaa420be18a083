"""Reserving the rank grid on a Ray cluster.

One STRICT_PACK placement group per tensor-parallel group: TP peers exchange
activations every layer, so they must share a node; pipeline and data-parallel
neighbours (less traffic) may spread across nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.errors import SpecError
from orchestrator.planning.snapshot_memory import check_nodes, host_bytes_per_rank
from orchestrator.spec import JobSpec
from workers.parallel.grid import Grid


def tp_groups(grid: Grid) -> int:
    """Placement groups a grid reserves: one per tensor-parallel group (TP peers are consecutive ranks)."""
    return grid.world_size // grid.tp


def tp_groups_per_replica(grid: Grid) -> int:
    """TP groups in one data-parallel replica: what growing or shrinking dp by one adds or frees."""
    return grid.positions // grid.tp


@dataclass
class RankPlacement:
    """The reserved placement groups, one per TP group, in rank order."""

    groups: list[PlacementGroup]
    tp: int

    def bundle(self, rank: int) -> tuple[int, int]:
        """``(group, bundle index)`` holding ``rank``: TP peers are consecutive ranks packed in one group."""
        return rank // self.tp, rank % self.tp

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        group, index = self.bundle(rank)
        return PlacementGroupSchedulingStrategy(placement_group=self.groups[group], placement_group_bundle_index=index)

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
    """Whether ``groups`` more TP groups of ``spec`` could be placed now (reserved, then given back at once)."""
    bundle = rank_bundle(spec, use_gpu)
    probe = [placement_group([bundle] * spec.parallel.tp, strategy="STRICT_PACK") for _ in range(groups)]
    try:
        return all(pg.wait(timeout_s) for pg in probe)
    finally:
        RankPlacement(groups=probe, tp=spec.parallel.tp).release()


def reserve(spec: JobSpec, use_gpu: bool, timeout_s: float = 120.0) -> RankPlacement:
    """Reserve every rank's bundle, or fail naming what could not be placed."""
    check_nodes(spec, [node["Resources"].get("memory", 0.0) for node in ray.nodes() if node["Alive"]])
    p, n_groups = spec.parallel, tp_groups(spec.parallel.grid)
    bundle = rank_bundle(spec, use_gpu)
    groups = [
        placement_group([bundle] * p.tp, strategy="STRICT_PACK", name=f"{spec.name}-tp{g}")
        for g in range(n_groups)
    ]
    placement = RankPlacement(groups=groups, tp=p.tp)
    try:
        ray.get([pg.ready() for pg in groups], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        placement.release()
        raise SpecError(
            "parallel.tp",
            p.tp,
            f"could not place {n_groups} groups of {p.tp} x {bundle} on single nodes "
            f"within {timeout_s:.0f}s (tensor-parallel peers must share a node)",
            "lower parallel.tp to what one node holds, or add nodes with more CPUs/GPUs",
        ) from None
    return placement
