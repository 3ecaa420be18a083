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
