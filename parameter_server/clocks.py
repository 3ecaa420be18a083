"""``ClockKeeper``: per-worker clocks for asp/ssp, the SSP read gate, and the step budget workers draw from.

Written here: no library offers bounded-staleness clocks. A worker at clock c
(it has pushed c updates) may start its next step only once the slowest
worker has reached c - staleness (``asp``: no bound). Workers run free (a
straggler holds nobody back) and draw steps from one budget, ``steps *
workers`` for the whole run, so the run consumes the same samples as BSP
whoever computes them; the controller's step r is over once ``r * workers``
worker steps have completed. ``pause`` stops new steps and waits for the
ones in flight, so the controller can restart a shard on a quiet server.

A worker that dies mid-step never ticks: ``hand_over`` gives its step in flight
back to the budget and ends this *generation* (every free-running loop and
every controller round started under it), so the group can be re-formed and
each worker, its replacement included, rejoins at its clock. Its clock stays
where it was meanwhile, so under SSP the others wait for it within the bound.
"""

from __future__ import annotations

import threading

WAIT_S = 600.0
LOST = "a peer worker was lost; the group is re-formed and every worker rejoins at its clock"


class ClockKeeper:
    def __init__(self, workers: int, staleness: int | None, steps: int):
        self.clocks = [0] * workers
        self.staleness = staleness  # None: asp
        self.budget = steps * workers
        self.started = 0
        self.completed = 0
        self.paused = False
        self.in_flight = [False] * workers  # entered, not yet ticked
        self.losses: list[float | None] = [None] * workers  # each worker's latest, reported again after a rejoin
        self.generation = 0  # bumped by ``hand_over``: the loops and rounds of an older one end
        self.cond = threading.Condition()

    def _wait(self, predicate, what: str) -> None:
        if not self.cond.wait_for(predicate, timeout=WAIT_S):
            raise TimeoutError(f"clock keeper waited {WAIT_S:.0f}s for {what}")

    def _may_start(self, worker: int) -> bool:
        bound_ok = self.staleness is None or min(self.clocks) >= self.clocks[worker] - self.staleness
        return not self.paused and bound_ok

    def enter(self, worker: int, generation: int = 0) -> bool:
        """Take one step from the budget for ``worker`` once the staleness bound allows; False: budget spent, or
        ``generation`` (the caller's loop's) was ended by ``hand_over``."""
        with self.cond:
            self._wait(lambda: self.started >= self.budget or generation != self.generation
                       or self._may_start(worker),
                       f"worker {worker} at clock {self.clocks[worker]} to be within the staleness bound")
            if self.started >= self.budget or generation != self.generation:
                return False
            self.started += 1
            self.in_flight[worker] = True
            return True

    def tick(self, worker: int, loss: float | None = None) -> int:
        """``worker`` finished a step (its push is acknowledged by every holder) with ``loss``."""
        with self.cond:
            self.losses[worker] = loss
            self.clocks[worker] += 1
            self.completed += 1
            self.in_flight[worker] = False
            self.cond.notify_all()
            return self.clocks[worker]

    def wait_completed(self, steps: int, generation: int = 0) -> int:
        """Block until ``steps`` worker steps have completed in total (the end of a controller step); a
        ``hand_over`` meanwhile ends the wait with an error (the round is abandoned with the lost worker)."""
        with self.cond:
            self._wait(lambda: self.completed >= steps or generation != self.generation,
                       f"{steps} completed worker steps")
            if generation != self.generation:
                raise RuntimeError(f"round abandoned at {self.completed} of {steps} worker steps: {LOST}")
            return self.completed

    def hand_over(self, lost: list[int]) -> dict:
        """Workers ``lost`` died: their steps in flight go back to the budget (a replacement does them again,
        at the same clock), this generation's loops and rounds end, and no step starts until ``resume``.
        Returns once the survivors' steps in flight are done, with the state to rejoin from."""
        with self.cond:
            for worker in lost:
                if self.in_flight[worker]:
                    self.in_flight[worker] = False
                    self.started -= 1
            self.paused = True
            self.generation += 1
            self.cond.notify_all()
            self._wait(lambda: self.completed == self.started, "the survivors' steps in flight")
            return self._state()

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
            self.in_flight = [False] * len(self.clocks)
            self.paused = False
            self.cond.notify_all()

    def state(self) -> dict:
        with self.cond:
            return self._state()

    def _state(self) -> dict:
        return {"clocks": list(self.clocks), "started": self.started, "completed": self.completed,
                "generation": self.generation, "losses": list(self.losses)}
