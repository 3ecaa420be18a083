"""``ClockKeeper``: per-worker clocks for asp/ssp, the SSP read gate, and the rounds the controller counts.

Written here: no library offers bounded-staleness clocks. A worker at clock c
(it has pushed c updates) may start its next step only once the slowest
worker has reached c - staleness (``asp``: no bound). The controller still
counts steps, so asynchronous training runs in *rounds*: round r ends once
r * workers steps have been started in total, whoever ran them, so a round
consumes one global batch of samples whether or not a straggler took part.
A worker waiting at the bound gives up when the round's steps are all taken,
which keeps the gate free of deadlock (the slowest worker never waits).
"""

from __future__ import annotations

import threading

WAIT_S = 600.0


class ClockKeeper:
    def __init__(self, workers: int, staleness: int | None):
        self.clocks = [0] * workers
        self.staleness = staleness  # None: asp
        self.started = 0
        self.cond = threading.Condition()

    def _may_read(self, clock: int) -> bool:
        return self.staleness is None or min(self.clocks) >= clock - self.staleness

    def enter(self, worker: int, round_: int) -> bool:
        """Take one of round ``round_``'s steps for ``worker`` once the staleness bound allows; False: round over."""
        target = round_ * len(self.clocks)
        with self.cond:
            ok = self.cond.wait_for(lambda: self.started >= target or self._may_read(self.clocks[worker]),
                                    timeout=WAIT_S)
            if not ok:
                raise TimeoutError(f"worker {worker} waited {WAIT_S:.0f}s at clock {self.clocks[worker]}")
            if self.started >= target:
                return False
            self.started += 1
            self.cond.notify_all()  # the round's last step taken: waiters at the bound may leave
            return True

    def tick(self, worker: int) -> int:
        """``worker`` finished a step (its push is acknowledged by every holder)."""
        with self.cond:
            self.clocks[worker] += 1
            self.cond.notify_all()
            return self.clocks[worker]

    def state(self) -> dict:
        with self.cond:
            return {"clocks": list(self.clocks), "started": self.started}
