"""Faults a rank injects into itself on the controller's order (the fault-injection harness's worker side).

Each is what the real failure looks like from outside: ``kill_rank`` is a
SIGKILL of the actor's process, ``kill_node`` a lost machine (the rank
SIGKILLs its node's raylet, then itself: Ray declares the node dead and
everything on it with it; on a ``ray.cluster_utils.Cluster`` that removes
one simulated node), ``hang_rank`` a step that never returns, ``slow_rank``
a straggler, ``nan_loss`` a step whose loss and gradients become NaN.

The trainer sees one ``StepFault`` per step and calls it around the step
(``before``, ``poisons_loss`` inside the loss, ``slow_down`` after), so no
fault kind is tested for anywhere else.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class StepFault:
    """The fault (a ``faults:`` entry as a dict, or None) injected into one step, as hooks around it."""

    fault: dict | None = None

    @property
    def poisons_loss(self) -> bool:
        """A ``nan_loss`` step multiplies its loss by NaN, so loss and gradients become NaN."""
        return self.fault is not None and self.fault["kind"] == "nan_loss"

    def before(self) -> None:
        """Kill or hang this rank before the step starts (the controller sees a dead or silent rank)."""
        kind = None if self.fault is None else self.fault["kind"]
        if kind == "kill_node":
            os.kill(int(os.environ["RAY_RAYLET_PID"]), signal.SIGKILL)  # set by Ray in every worker process
        if kind in ("kill_rank", "kill_node"):
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "hang_rank":
            while True:
                time.sleep(3600)

    def slow_down(self, step_s: float) -> float:
        """A ``slow_rank`` stretches its step to ``factor`` times; returns the seconds added, which the rank
        counts as its own compute and step time (as a slower device would), so straggler detection sees it."""
        if self.fault is None or self.fault["kind"] != "slow_rank":
            return 0.0
        extra = (self.fault["factor"] - 1.0) * step_s
        time.sleep(extra)
        return extra


NO_FAULT = StepFault()
