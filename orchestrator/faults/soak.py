"""Repeating faults for soak runs: a fault with ``every_s`` fires again and again, deterministic by ``seed``.

The gaps (``every_s`` ± uniform ``jitter_s``) and, with ``rank: random``, the
victims come from one ``random.Random(seed)``, so two runs with the same seed
draw the same sequence; which step a firing lands on depends on how fast the
steps run. A firing due while training has not yet got past the step of the
previous firing (a recovery rolled it back and is redoing steps) waits until
it has, so a failure rate above the recovery rate still lets training advance
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
        self.next_at: float | None = None  # set when the first step is issued
        self.fired_at: int = 0  # the step of the previous firing

    def _gap(self) -> float:
        jitter = self.fault["jitter_s"]
        return self.fault["every_s"] + (self.rng.uniform(-jitter, jitter) if jitter else 0.0)

    def due(self, step: int, world_size: int) -> dict | None:
        """The one-shot fault to inject at ``step`` if the next firing time has passed, else None."""
        now = self.clock()
        if self.next_at is None:
            self.next_at = now + self._gap()
        if now < self.next_at or step <= self.fired_at:
            return None
        self.next_at = now + self._gap()
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
        if fault.jitter_s:
            raise SpecError(f"{where}.jitter_s", fault.jitter_s, "only applies to a repeating fault",
                            "remove jitter_s, or set every_s")
        return
    if fault.kind == "slow_rank":
        raise SpecError(f"{where}.every_s", fault.every_s, "does not apply to slow_rank, which stays slow from "
                        "at_step on", "use at_step for slow_rank")
    if fault.jitter_s >= fault.every_s:
        raise SpecError(f"{where}.jitter_s", fault.jitter_s, f"is not below every_s={fault.every_s}, so a gap "
                        "between faults could be zero or negative", f"set jitter_s below {fault.every_s}")
