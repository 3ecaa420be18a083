"""Where a recovery's time goes: seconds per phase, from the fault to the next completed step.

Phases, in order (those a recovery path skips are absent): ``detect`` (the
failed step was issued until the controller saw a rank dead), ``survivors``
(the other ranks' failed step ended: those blocked on the dead peer wait up
to the collective timeout; the replacement actors start meanwhile),
``replace`` (what was left of the new actors' start: process, imports), ``form`` (every rank re-joined
a new process group and rebuilt its model), ``restore`` (state rolled back
from memory or disk), ``snapshot`` (the first snapshot of the new group),
``restart`` (``restart_all``: the whole grid again), ``shrink`` (a smaller
grid started) and ``first_step`` (the next step completed). They sum to the
recovery's ``mttr_s``.
"""

from __future__ import annotations

import time


class RecoveryPhases:
    def __init__(self, fault_time: float):
        self.start = self.last = fault_time
        self.seconds: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        """``phase`` ended now."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now

    def total(self) -> float:
        return self.last - self.start
