"""Faults a rank injects into itself on the controller's order (the fault-injection harness's worker side).

Each is what the real failure looks like from outside: ``kill_rank`` is a
SIGKILL of the actor's process, ``kill_node`` a lost machine (the rank
SIGKILLs its node's raylet, then itself: Ray declares the node dead and
everything on it with it; on a ``ray.cluster_utils.Cluster`` that removes
one simulated node), ``hang_rank`` a step that never returns, ``slow_rank``
a straggler, ``nan_loss`` a step whose loss and gradients become NaN, ``raise_error`` an exception
inside a live rank's step (an I/O error, a full disk, a bug) and ``oom`` one that reports running out
of memory.

The step engine (``workers.step.engine``) sees one ``StepFault`` per step and calls it around the step
(``before``, ``poisons_loss`` inside the loss, ``slow_down`` after; an asp/ssp round slows each local step),
so no fault kind is tested for anywhere else.
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
        if kind == "raise_error":
            raise InjectedError("injected error (fault raise_error)")
        if kind == "oom":
            raise MemoryError("injected out of memory (fault oom)")

    def slow_down(self, step_s: float) -> float:
        """A ``slow_rank`` stretches its step to ``factor`` times; returns the seconds added, which the rank
        counts as its own compute and step time (as a slower device would), so straggler detection sees it."""
        if self.fault is None or self.fault["kind"] != "slow_rank":
            return 0.0
        extra = (self.fault["factor"] - 1.0) * step_s
        time.sleep(extra)
        return extra


NO_FAULT = StepFault()


class RankStepError(Exception):
    """Why one rank's step raised, as the controller needs it: ``kind`` is ``oom`` (out of memory), ``peer_lost``
    (a collective broke because a peer died or left its group: the rank itself is sound) or ``error`` (anything
    else: an I/O error, a full disk, a bug); ``detail`` is the original exception in one line.

    Only strings travel (never the original exception), so the controller needs neither torch nor the
    exception's class to read it.
    """

    def __init__(self, kind: str, detail: str):
        super().__init__(kind, detail)

    @property
    def kind(self) -> str:
        return self.args[0]

    @property
    def detail(self) -> str:
        return self.args[1]

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"

    @classmethod
    def of(cls, exc: BaseException) -> RankStepError:
        detail = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        text = str(exc)
        if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or "out of memory" in text.lower():
            return cls("oom", detail)
        if any(mark in text for mark in _PEER_LOST):
            return cls("peer_lost", detail)
        return cls("error", detail)


# what gloo and NCCL say when a collective's peer died, timed out or left its process group
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out", "timed out",
              "NCCL", "gloo", "ProcessGroup", "process group",
              "a peer worker was lost")  # parameter_server.clocks.LOST: an asp/ssp round ended by hand_over


class InjectedError(RuntimeError):
    """The exception a ``raise_error`` fault throws inside the step (an I/O error or a bug, as seen from outside)."""
