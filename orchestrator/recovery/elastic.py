"""Elastic data parallelism: how far to shrink when a dead rank cannot be replaced, and when to grow back.

Only the number of data-parallel replicas changes; pp×tp stays (another model
split would be another plan). The microbatch count scales inversely, so each
microbatch keeps its size and gradient accumulation keeps the global batch.
How many replicas fit is counted from the live nodes' resources (a TP group
must fit on one node) and then proven by reserving it. Ray Train's and
torchrun's elastic modes restart every worker at whatever size they get; this
policy (largest fitting dp, a floor, growing back to the requested dp) is ours.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec
from workers.contract.grid import Grid

# (spec, use_gpu, TP groups, timeout s) -> whether that many more TP groups of the job could be placed now: the
# runtime's placement probe (``orchestrator.runtime.placement.can_reserve``), handed in by the runtime
CanReserve = Callable[[JobSpec, bool, int, float], bool]


def resized(spec: JobSpec, dp: int) -> JobSpec:
    """``spec`` at ``dp`` replicas with the global batch and, where it divides, the microbatch size kept.

    Faults aimed at ranks the smaller grid no longer has are dropped from the copy (the running
    job's schedule keeps them). Raises ``SpecError`` for a degree the job file could not have.
    """
    raw = spec.to_dict()
    microbatches = spec.train.microbatches * spec.parallel.dp
    raw["parallel"]["dp"] = dp
    if microbatches % dp == 0:
        raw["train"]["microbatches"] = microbatches // dp
    world = spec.parallel.grid.with_dp(dp).world_size
    raw["faults"] = [f for f in raw["faults"] if f["rank"] < world]
    return JobSpec.from_dict(raw)


def node_groups_per_replica(grid: Grid) -> int:
    """Node blocks (tp x cp peers, ``Grid.node_block``) in one data-parallel replica: what growing or shrinking dp
    by one adds or frees."""
    return grid.positions // grid.node_block


def groups_that_fit(spec: JobSpec, use_gpu: bool) -> int:
    """Node blocks of ``spec`` the live nodes hold in total (each block on one node)."""
    p, block = spec.parallel, spec.parallel.grid.node_block
    total = 0
    for node in ray.nodes():
        if node["Alive"]:
            res = node["Resources"]
            fits = res.get("CPU", 0.0) // (p.cpus_per_rank * block)
            if use_gpu:
                fits = min(fits, res.get("GPU", 0.0) // block)
            total += int(fits)
    return total


class ElasticPolicy:
    """Decides the dp to shrink to or grow back to; the controller executes the resize."""

    def __init__(self, spec: JobSpec, can_reserve: CanReserve):
        self.target_dp = spec.parallel.dp  # what the job asked for (or was last asked to scale to)
        self.can_reserve = can_reserve
        self._next_check = 0.0

    def shrink_options(self, spec: JobSpec, use_gpu: bool) -> list[JobSpec]:
        """Layouts to try, largest dp the live nodes hold first, down to ``fault_tolerance.min_dp``."""
        p, floor = spec.parallel, spec.fault_tolerance.min_dp
        fit = min(p.dp, groups_that_fit(spec, use_gpu) // node_groups_per_replica(p.grid))
        options, refused = [], []
        for dp in range(fit, floor - 1, -1):
            try:
                options.append(resized(spec, dp))
            except SpecError as exc:  # e.g. the global batch does not split over dp
                refused.append(str(exc))
        if fit < floor:
            raise RuntimeError(
                f"fault_tolerance.min_dp={floor}: the live nodes now hold only dp={fit} (replicas of pp={p.pp} x "
                f"tp={p.tp} ranks, {p.cpus_per_rank:g} CPUs each); fix: add nodes, or lower fault_tolerance.min_dp"
                + (f" to {fit}" if fit >= 1 else "")
            )
        if not options:
            raise RuntimeError(f"no dp from {fit} (what the live nodes hold) down to fault_tolerance.min_dp={floor} "
                               f"makes a valid job: {refused[-1]}")
        return options

    def grow(self, spec: JobSpec, use_gpu: bool) -> JobSpec | None:
        """A layout with more replicas (up to the requested dp) once the cluster has room again, else None.

        Looks every ``fault_tolerance.grow_check_s``; reserves the extra groups to be sure, then gives them back.
        """
        p, ft = spec.parallel, spec.fault_tolerance
        now = time.monotonic()
        if p.dp >= self.target_dp or now < self._next_check:
            return None
        self._next_check = now + ft.grow_check_s
        per_replica = node_groups_per_replica(p.grid)
        fit = min(self.target_dp, groups_that_fit(spec, use_gpu) // per_replica)
        for dp in range(fit, p.dp, -1):
            try:
                bigger = resized(spec, dp)
            except SpecError:
                continue
            if self.can_reserve(spec, use_gpu, (dp - p.dp) * per_replica, min(ft.placement_timeout_s, 10.0)):
                return bigger
        return None
