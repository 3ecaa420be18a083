"""Faults a rank injects into itself on the controller's order (the fault-injection harness's worker side).

Each is what the real failure looks like from outside: ``kill_rank`` is a
SIGKILL of the actor's process, ``kill_node`` a lost machine (the rank
SIGKILLs its node's raylet, then itself: Ray declares the node dead and
everything on it with it; on a ``ray.cluster_utils.Cluster`` that removes
one simulated node), ``hang_rank`` a step that never returns, ``slow_rank``
a straggler, ``nan_loss`` a step whose loss and gradients become NaN.
"""

from __future__ import annotations

import os
import signal
import time


def before_step(fault: dict | None) -> None:
    if fault is None:
        return
    if fault["kind"] == "kill_node":
        os.kill(int(os.environ["RAY_RAYLET_PID"]), signal.SIGKILL)  # set by Ray in every worker process
    if fault["kind"] in ("kill_rank", "kill_node"):
        os.kill(os.getpid(), signal.SIGKILL)
    if fault["kind"] == "hang_rank":
        while True:
            time.sleep(3600)


def slow_down(fault: dict | None, step_s: float) -> float:
    """A ``slow_rank`` stretches its step to ``factor`` times; returns the seconds added, which the rank
    counts as its own compute and step time (as a slower device would), so straggler detection sees it."""
    if fault is None or fault["kind"] != "slow_rank":
        return 0.0
    extra = (fault["factor"] - 1.0) * step_s
    time.sleep(extra)
    return extra
