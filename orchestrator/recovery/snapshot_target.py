"""Which in-memory snapshot step a recovery rolls back to.

Snapshots replicate in the background (``workers.state.snapshot_store``), so at a
failure the ranks may hold different sets of complete steps: survivors their
own recent snapshots, holders the replicas their peers finished shipping. The
step to restore is the newest one present in every list a rank restores from
(a survivor's own, a replaced rank's holder's replica), and no later than the
last step the controller saw succeed (a failed or NaN step's snapshot is
never used). A replica that was still in flight is in no list, so it is never
picked half-shipped.
"""

from __future__ import annotations

from collections.abc import Iterable


def newest_common_step(step_lists: Iterable[Iterable[int]], up_to: int) -> int | None:
    """The newest step in every one of ``step_lists`` that is at most ``up_to``; None when there is none."""
    common: set[int] | None = None
    for steps in step_lists:
        common = set(steps) if common is None else common & set(steps)
    return max((s for s in common or () if s <= up_to), default=None)


def replica_holders(grid, node_of: dict[int, str]) -> dict[int, int | None]:
    """Each rank's replica holder: the grid's replica peer (``Grid.replica_peer``), unless it shares the rank's node
    while another rank that can hold it (the same model position in another data-parallel replica; any other rank
    without data parallelism) lives elsewhere: then the first such rank, in the peer's order, on another node.

    Why: a holder on the rank's own node dies with it when the node goes, and the recovery falls back to disk.
    The grid's order usually gives another node already (data parallelism is outermost), but placement may
    pack replicas together, and only the placed nodes (``node_of``: rank -> node id) tell.
    """
    holders = {}
    for rank in grid.ranks():
        peer = grid.replica_peer(rank)
        if peer is None or node_of.get(peer) != node_of.get(rank):
            holders[rank] = peer
            continue
        step = grid.positions if grid.dp_enabled else 1
        candidates = ((rank + k * step) % grid.world_size for k in range(1, grid.world_size // step))  # lazily: the
        holders[rank] = next((c for c in candidates if node_of.get(c) != node_of.get(rank)), peer)  # first hit ends it
    return holders
