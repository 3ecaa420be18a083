"""Host memory that in-memory snapshots hold: planned with the rest, reserved with each rank's placement.

A snapshot (``workers.state.snapshot.take``) is a host copy of the rank's parameters and optimizer state, what
is on the device and what was offloaded alike. A rank keeps two of its own: the newest, and the one before it
until every rank has replicated the newest (``SnapshotStore.keep``). Where replicas ship (not between mirrors,
``replicas_mirror``) its holder keeps two of its peer's as well, the acknowledged one and the one arriving. On
a GPU none of this shows in a device figure, yet a rank whose state fills an 80 GB device holds 160 to 320 GB of
host memory in snapshots, and eight of them overrun most nodes' RAM; the host's OOM killer then takes ranks
down again and again, each recovery taking more snapshots. So each rank's placement bundle asks Ray for these
bytes as its ``memory`` resource (``rank_bundle``): Ray places no more ranks on a node than its memory holds,
and a job that no node can hold is refused before any actor starts (``check_nodes``).

Written here because neither Ray nor PyTorch knows what a snapshot will hold; the bytes come from the memory
planner's per-rank model state (``estimate``), the figure ``raymesh plan`` shows.
"""

from __future__ import annotations

from orchestrator.errors import SpecError
from orchestrator.planning.estimate import stage_estimates
from orchestrator.spec import JobSpec
from orchestrator.spec.sections import dp_replicas_mirror, ps_replicas_mirror
from orchestrator.units import human_bytes

OWN_COPIES = 2  # the newest snapshot, and the one before until every rank has replicated the newest
HELD_COPIES = 2  # a peer's replicas a holder keeps: the acknowledged one and the one arriving


def replicas_mirror(spec: JobSpec) -> bool:
    """Whether a rank's replica holder already holds the same state in its own snapshots, so none ships."""
    return dp_replicas_mirror(spec.parallel, spec.optim) or ps_replicas_mirror(spec.parallel, spec.parameter_server)


def snapshot_bytes(spec: JobSpec) -> int:
    """Bytes of one snapshot of the rank with the most state: its parameters and optimizer state, offloaded or
    not, and compression's error feedback (gradients are not kept)."""
    return max(r.state.params + r.state.optimizer + r.state.offloaded + r.feedback_bytes
               for r in stage_estimates(spec))


def copies(spec: JobSpec) -> int:
    """Snapshots a rank holds at once: none without in-memory snapshots, its own two, and two of its peer's
    where replicas ship (a one-rank job has no peer)."""
    if not spec.checkpoint.snapshot_every(spec.parallel, spec.optim):
        return 0
    ships = spec.parallel.world_size > 1 and not replicas_mirror(spec)
    return OWN_COPIES + (HELD_COPIES if ships else 0)


def host_bytes_per_rank(spec: JobSpec) -> int:
    """Host memory a rank's in-memory snapshots hold at their high point."""
    held = copies(spec)
    return held * snapshot_bytes(spec) if held else 0


def describe(spec: JobSpec) -> str:
    """One line for ``raymesh plan``: what the snapshots hold in host memory, per rank and per tensor-parallel
    group (the ranks that must share a node)."""
    held = copies(spec)
    if not held:
        return "in-memory snapshots: off (checkpoint.memory_every: 0), no host memory held for them"
    per_rank, tp = host_bytes_per_rank(spec), spec.parallel.tp
    group = f", {human_bytes(tp * per_rank)} per tensor-parallel group of {tp} (one node)" if tp > 1 else ""
    one = human_bytes(snapshot_bytes(spec))
    return (f"in-memory snapshots: {held} copies of up to {one} = {human_bytes(per_rank)} of host memory a "
            f"rank{group}, reserved with its placement")


def check_nodes(spec: JobSpec, node_memory: list[float]) -> None:
    """Refuse a job whose tensor-parallel group (placed on one node) needs more snapshot memory than any node
    offers Ray (``node_memory``: each live node's ``memory`` resource, bytes)."""
    need = spec.parallel.tp * host_bytes_per_rank(spec)
    largest = max(node_memory, default=0.0)
    if not need or need <= largest:
        return
    every = spec.checkpoint.snapshot_every(spec.parallel, spec.optim)
    raise SpecError(
        "checkpoint.memory_every", every,
        f"keeps {copies(spec)} in-memory snapshots of up to {human_bytes(snapshot_bytes(spec))} per rank, "
        f"{human_bytes(need)} of host memory for a tensor-parallel group of {spec.parallel.tp} on one node, but the "
        f"largest node offers Ray {human_bytes(largest)}",
        "set checkpoint.memory_every: 0 (disk checkpoints only), or shard the state over more ranks "
        "(parallel.zero: 3 with a larger parallel.dp, or more parallel.pp), or add nodes with more memory")
