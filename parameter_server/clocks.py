"""``ClockKeeper``: per-worker clocks for asp/ssp, the SSP read gate, and the step budget workers draw from.

Written here: no library offers bounded-staleness clocks. A worker at clock c
(it has pushed c updates) may start its next step only once the slowest
worker has reached c - staleness (``asp``: no bound). Workers run free (a
straggler holds nobody back) and draw steps from one budget, ``steps *
workers`` for the whole run, so the run consumes the same samples as BSP
whoever computes them; the controller's step r is over once ``r * workers``
worker steps have completed. ``pause`` stops new steps and waits for the
ones in flight, so the controller can restart a shard on a quiet server.
"""

from __future__ import annotations

import threading

WAIT_S = 600.0


class ClockKeeper:
    def __init__(self, workers: int, staleness: int | None, steps: int):
        self.clocks = [0] * workers
        self.staleness = staleness  # None: asp
        self.budget = steps * workers
        self.started = 0
        self.completed = 0
        self.paused = False
        self.cond = threading.Condition()

    def _wait(self, predicate, what: str) -> None:
        if not self.cond.wait_for(predicate, timeout=WAIT_S):
            raise TimeoutError(f"clock keeper waited {WAIT_S:.0f}s for {what}")

    def _may_start(self, worker: int) -> bool:
        bound_ok = self.staleness is None or min(self.clocks) >= self.clocks[worker] - self.staleness
        return not self.paused and bound_ok

    def enter(self, worker: int) -> bool:
        """Take one step from the budget for ``worker`` once the staleness bound allows; False: budget spent."""
        with self.cond:  # paused, even a worker whose budget is spent waits: its last pull must not meet a
            # shard restart or a resize half done
            self._wait(lambda: not self.paused and (self.started >= self.budget or self._may_start(worker)),
                       f"worker {worker} at clock {self.clocks[worker]} to be within the staleness bound")
            if self.started >= self.budget:
                return False
            self.started += 1
            return True

    def tick(self, worker: int) -> int:
        """``worker`` finished a step (its push is acknowledged by every holder)."""
        with self.cond:
            self.clocks[worker] += 1
            self.completed += 1
            self.cond.notify_all()
            return self.clocks[worker]

    def wait_completed(self, steps: int) -> int:
        """Block until ``steps`` worker steps have completed in total (the end of a controller step)."""
        with self.cond:
            self._wait(lambda: self.completed >= steps, f"{steps} completed worker steps")
            return self.completed

    def pause(self) -> None:
        with self.cond:
            self.paused = True
            self._wait(lambda: self.completed == self.started, "the steps in flight")

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def restore(self, clocks: list[int], completed: int) -> None:
        """Continue from a checkpoint (or a rollback): ``completed`` worker steps done, each worker at its clock;
        the budget stays the whole run's."""
        with self.cond:
            self.clocks = list(clocks)
            self.started = self.completed = completed
            self.cond.notify_all()

    def state(self) -> dict:
        with self.cond:
            return {"clocks": list(self.clocks), "started": self.started, "completed": self.completed}
