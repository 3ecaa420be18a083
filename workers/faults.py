"""Faults a rank injects into itself on the controller's order (the fault-injection harness's worker side).

Each is what the real failure looks like from outside: ``kill_rank`` is a
SIGKILL of the actor's process, ``hang_rank`` a step that never returns,
``slow_rank`` a straggler, ``nan_loss`` a step whose loss and gradients
become NaN.
"""

from __future__ import annotations

import os
import signal
import time


def before_step(fault: dict | None) -> None:
    if fault is None:
        return
    if fault["kind"] == "kill_rank":
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
