"""Repeating faults for soak runs: a fault with ``every_s`` fires again and again, deterministic by ``seed``.

The n-th firing is due ``n × every_s`` (± uniform ``jitter_s``) after the
first step, on a fixed grid: the jitter moves each firing within its own
interval and never adds up, so a window of D seconds holds at least
``floor((D - jitter_s) / every_s)`` failures whatever the draws. (Gaps drawn
from one firing to the next used to drift: at 60 ± 10 s the second failure
could land past 130 s, and a benchmark of "one failure a minute" saw one.)
The jitter and, with ``rank: random``, the victims come from one
``random.Random(seed)``, so two runs with the same seed draw the same
sequence; which step a firing lands on depends on how fast the steps run. A
firing due while training has not yet got past the step of the previous
firing (a recovery rolled it back and is redoing steps) waits until it has,
so a failure rate above the recovery rate still lets training advance
instead of failing the same step forever.
"""

from __future__ import annotations

import random
import time

from orchestrator.errors import SpecError


class RepeatingFault:
    def __init__(self, fault: dict, clock=time.monotonic):
        self.fault = fault
        self.clock = clock
        self.rng = random.Random(fault["seed"])
        self.start: float | None = None  # when the first step was issued: the grid's origin
        self.firings = 0
        self.next_at: float | None = None
        self.fired_at: int = 0  # the step of the previous firing

    def _time_of_next(self) -> float:
        """When the next firing is due: its grid point, moved by this firing's own jitter."""
        jitter = self.fault["jitter_s"]
        return (self.start + (self.firings + 1) * self.fault["every_s"]
                + (self.rng.uniform(-jitter, jitter) if jitter else 0.0))

    def due(self, step: int, world_size: int) -> dict | None:
        """The one-shot fault to inject at ``step`` if the next firing time has passed, else None."""
        now = self.clock()
        if self.start is None:
            self.start = now
            self.next_at = self._time_of_next()
        if now < self.next_at or step <= self.fired_at:
            return None
        self.firings += 1
        self.next_at = self._time_of_next()
        self.fired_at = step
        rank = self.rng.randrange(world_size) if self.fault["rank"] == "random" else self.fault["rank"]
        return {"kind": self.fault["kind"], "rank": rank, "at_step": step, "factor": self.fault["factor"]}


def check_repetition(fault, where: str) -> None:
    """A fault has either ``at_step`` (once) or ``every_s`` (repeating); the repeating-only keys need ``every_s``."""
    if fault.at_step is None and fault.every_s is None:
        raise SpecError(f"{where}.at_step", None, "is missing: a fault fires at a step or repeats",
                        "set at_step: N to fire once at step N, or every_s: S to fire every S seconds")
    if fault.at_step is not None and fault.every_s is not None:
        raise SpecError(f"{where}.every_s", fault.every_s, f"is set together with at_step={fault.at_step}",
                        "keep at_step to fire once, or every_s to repeat, not both")
    if fault.every_s is None:
        if fault.rank == "random":
            raise SpecError(f"{where}.rank", "random", "only applies to a repeating fault",
                            "give a rank number, or set every_s")
        for key in ("jitter_s", "seed"):  # both shape the draws of repeating firings only
            if getattr(fault, key):
                raise SpecError(f"{where}.{key}", getattr(fault, key), "only applies to a repeating fault",
                                f"remove {key}, or set every_s")
        return
    if fault.kind == "slow_rank":
        raise SpecError(f"{where}.every_s", fault.every_s, "does not apply to slow_rank, which stays slow from "
                        "at_step on", "use at_step for slow_rank")
    if fault.jitter_s >= fault.every_s / 2:
        raise SpecError(f"{where}.jitter_s", fault.jitter_s, f"is not below half of every_s={fault.every_s}, so "
                        "two firings could coincide or swap (each moves within its own every_s interval)",
                        f"set jitter_s below {fault.every_s / 2}")
