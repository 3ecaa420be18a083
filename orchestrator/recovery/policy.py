"""What to do about a failed step or a change of cluster size: pure decisions, no Ray, no I/O.

The controller used to carry these rules inline between the calls that carry
them out; here they are objects a test can question directly, and the
controller only executes what they return. ``RecoveryPolicy`` decides, for a
failed step, between replacing the dead ranks (and then rolling back from
memory or disk, or shrinking when the replacements found no room), restarting
the whole grid, and giving up with the error users already know.
``ScalingPolicy`` decides when the grid changes its data-parallel degree:
an explicit request first, else growing back (``ElasticPolicy``'s rule).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from enum import Enum

from orchestrator.spec import JobSpec

NAN_WITHOUT_SNAPSHOT = ("a step produced a non-finite loss and there is no in-memory snapshot to roll back to; "
                        "set checkpoint.memory_every (e.g. 1) to recover from NaN steps")


class Action(str, Enum):
    REPLACE = "replace"  # new actors for the dead ranks, then a placement check
    RESTART_ALL = "restart_all"  # tear the grid down, start it again, load the last checkpoint
    KEEP_TRAINING = "keep_training"  # new actors for the dead ranks; the other replicas step on meanwhile
    ROLL_BACK = "roll_back"  # every rank back to ``Decision.source`` (memory or disk)
    SKIP_BATCH = "skip_batch"  # roll back, then skip the batch of ``Decision.step`` (NaN again and again there)
    SHRINK = "shrink"  # the replacements found no room: a smaller grid
    GIVE_UP = "give_up"  # raise ``Decision.message``


@dataclass(frozen=True)
class Decision:
    action: Action
    source: str | None = None  # ROLL_BACK: "memory" or "disk"
    message: str | None = None  # GIVE_UP: the error to raise
    step: int | None = None  # SKIP_BATCH: the step whose batch is skipped


@dataclass(frozen=True)
class Failure:
    """What the policy needs to know about a failed step."""

    kind: str  # rank | hang | nan_loss (a dead rank's node may make it "node" later)
    dead: frozenset[int]
    at_step: int
    reason: str  # the failure as users read it ("rank 1 died")


def ranks_that_failed(errors: dict) -> dict[int, str]:
    """Which of the ranks whose step raised (``RankStepError`` by rank, none dead) failed on their own.

    A rank whose collective broke (``peer_lost``) is a survivor of another rank's failure; the others (out
    of memory, any other error) are replaced. When every one says ``peer_lost`` none can be told from the
    rest, and all are replaced.
    """
    own = {r: e for r, e in errors.items() if e.kind != "peer_lost"} or errors
    return {r: ("ran out of memory" if e.kind == "oom" else "raised") + f" ({e.detail})" for r, e in own.items()}


class RestartWindow:
    """Rank restarts within the last ``window_s`` seconds: the restart budget is a rate, not a lifetime count.

    Why: a lifetime budget ends a long run at its n-th failure however far apart they were (a soak losing a rank
    a minute died at the 4th), while what the budget is for is a crash loop: the same rank failing again at
    once, which spends a rate budget within minutes just the same. ``clock`` is injectable for tests.
    """

    def __init__(self, window_s: float, clock=time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._spent: deque[tuple[float, int]] = deque()  # (when, how many ranks), oldest first

    def spend(self, ranks: int) -> int:
        """Count ``ranks`` restarts now; returns the restarts within the window, these included."""
        now = self.clock()
        self._spent.append((now, ranks))
        while self._spent[0][0] <= now - self.window_s:
            self._spent.popleft()
        return sum(n for _, n in self._spent)


class RecoveryPolicy:
    """Rules for one job's ``fault_tolerance`` settings."""

    def __init__(self, spec: JobSpec):
        ft = spec.fault_tolerance
        self.mode = ft.recovery
        self.max_restarts = ft.max_restarts
        self.window_s = ft.restart_window_s
        self.nan_retries = ft.nan_retries
        self.on_repeated_nan = ft.on_repeated_nan

    def on_failure(self, failure: Failure, restarts: int) -> Decision:
        """First decision on a failed step; ``restarts`` are those within the restart window, its dead ranks
        already counted (``RestartWindow.spend``)."""
        if restarts > self.max_restarts:
            return Decision(Action.GIVE_UP, message=(
                f"{failure.reason} at step {failure.at_step}: {restarts} rank restarts within "
                f"{self.window_s:g} s exceed fault_tolerance.max_restarts={self.max_restarts} (per "
                f"fault_tolerance.restart_window_s={self.window_s:g}): the run is failing faster than it recovers; "
                "look at the failing rank's log (`ray logs actor`), or raise max_restarts"))
        if self.mode == "restart_all":
            return Decision(Action.RESTART_ALL, source="disk")
        if self.mode == "keep_training" and failure.dead:  # a NaN step (none dead) rolls back as ever
            return Decision(Action.KEEP_TRAINING)
        if failure.dead:
            return Decision(Action.REPLACE)
        return Decision(Action.ROLL_BACK)  # NaN loss: every rank is alive; ``roll_back`` says from where

    def on_failed_recovery(self, reason: str, at_step: int, attempts: int) -> Decision:
        """The ``attempts``-th recovery in a row that failed (a rank lost while re-forming or restoring) with no
        step completed since: try again, or give up once ``max_restarts`` attempts failed.

        Why ``max_restarts`` without its window: every failed attempt restarted at least one rank, and attempts
        that each take as long as the window (a replacement hanging while it forms) leave it as fast as they
        arrive, so the rate never reaches the budget and the run retried forever without training a step."""
        if attempts < self.max_restarts:
            return Decision(Action.REPLACE)
        return Decision(Action.GIVE_UP, message=(
            f"the recovery from the failure at step {at_step} failed {attempts} times in a row, no step completing "
            f"in between (the last time: {reason}); fault_tolerance.max_restarts={self.max_restarts} also caps "
            "failed recoveries in a row, whatever restart_window_s; look at the failing rank's log "
            "(`ray logs actor`), or raise fault_tolerance.max_restarts"))

    def on_nan(self, at_step: int, times: int) -> Decision:
        """The ``times``-th non-finite loss at ``at_step``: run it again, skip its batch, or stop.

        A NaN from a transient cause (a flipped bit, a race) is gone when the step runs again; one that
        comes back at the same step comes from the data or the state, and re-running it forever was a hang.
        """
        if times <= self.nan_retries:
            return Decision(Action.ROLL_BACK)
        if self.on_repeated_nan == "skip_batch":
            return Decision(Action.SKIP_BATCH, step=at_step)
        return Decision(Action.GIVE_UP, message=(
            f"step {at_step} produced a non-finite loss {times} times (rolled back and run again "
            f"{times - 1} times): the data or the state at that step makes it NaN; fix: lower optim.lr or "
            "raise optim.grad_clip, or set fault_tolerance.on_repeated_nan: skip_batch to skip that batch"))

    def on_placement(self, placed: bool) -> Decision:
        """After the replacements had ``placement_timeout_s`` to start."""
        return Decision(Action.ROLL_BACK) if placed else Decision(Action.SHRINK)

    def roll_back(self, snapshot_usable: bool, replaced: bool, newer_on_disk: bool = False) -> Decision:
        """Where every rank rolls back to: whichever of the in-memory snapshots and the latest good checkpoint
        loses fewer steps (``newer_on_disk``: the checkpoint holds a later step); the snapshots on a tie, as
        nothing is read from storage; the checkpoint when there is no snapshot.

        A NaN step (nothing ``replaced``) with no snapshot has no checkpoint-shaped answer: every rank is alive
        with the bad state, and the disk would lose the steps since the last save silently, so it is an error to
        fix. A checkpoint newer than the snapshot is fine for it: its step completed with a finite loss.
        """
        if newer_on_disk:
            return Decision(Action.ROLL_BACK, source="disk")
        if snapshot_usable:
            return Decision(Action.ROLL_BACK, source="memory")
        if not replaced:
            return Decision(Action.GIVE_UP, message=NAN_WITHOUT_SNAPSHOT)
        return Decision(Action.ROLL_BACK, source="disk")


class ScalingPolicy:
    """When the grid changes its data-parallel degree: a request (``raymesh scale``) first, else grow back.

    ``elastic`` is an ``ElasticPolicy`` (or a fake with its ``target_dp``, ``grow`` and ``shrink_options``).
    Requests arrive on the control API's thread, hence the lock.
    """

    def __init__(self, elastic):
        self.elastic = elastic
        self._lock = threading.Lock()
        self._requested: JobSpec | None = None

    def request(self, target: JobSpec) -> None:
        with self._lock:
            self._requested = target
            self.elastic.target_dp = target.parallel.dp  # automatic grow-back aims here from now on

    def next_resize(self, spec: JobSpec, use_gpu: bool) -> tuple[JobSpec, str] | None:
        """The layout to move to after this step and why (``request`` or ``grow``), or None to stay."""
        with self._lock:
            target, self._requested = self._requested, None
        if target is not None:
            return target, "request"
        grown = self.elastic.grow(spec, use_gpu)
        return (grown, "grow") if grown is not None else None

    def shrink_options(self, spec: JobSpec, use_gpu: bool) -> list[JobSpec]:
        return self.elastic.shrink_options(spec, use_gpu)
