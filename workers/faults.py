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


def after_step(fault: dict | None, step_s: float) -> None:
    if fault is not None and fault["kind"] == "slow_rank":
        time.sleep((fault["factor"] - 1.0) * step_s)
