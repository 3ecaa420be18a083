"""``RankLoop``: a participant (one rank, or a host of virtual ranks) runs a window of steps on its own.

After each step every participant joins one exchange (``tree.TreeExchange``): its step summary goes up, rank 0
merges them, hands the record to the controller through its ``Desk`` and decides the ``Boundary`` (the window
fails on a non-finite loss, stops when the controller asked, the next step's live faults, the snapshot floor, an
asynchronous save finished everywhere), which comes back down. Every participant then acts on that same
decision: snapshot, checkpoint (a save is followed by one more exchange of its outcome, so rank 0 reports it
written, or failed with the first rank's cause), stop. The controller is never on the step's path: it reads the
desk and posts requests, and a rank that dies or hangs breaks the exchange for everyone within a step.
"""

from __future__ import annotations

import time
from typing import Protocol

from workers.loop.desk import Desk
from workers.loop.plan import (
    Boundary,
    CheckpointPlan,
    LoopFailed,
    Progress,
    SaveRecord,
    StepRecord,
    Window,
    WindowEnd,
)
from workers.loop.summary import SaveOutcome, SaveState, StepSummary
from workers.loop.tree import TreeExchange

# the controller's request while it diagnoses a hang: a step that completes meanwhile (a frozen rank continued to
# write its stacks) fails instead, so no snapshot replaces the one the recovery rolls back to
HUNG = "hung"
FAULT_SYNC_S = 30.0  # how long rank 0 waits, before a step a drill's fault hits, for the controller to take its records


class Stepper(Protocol):
    """What a loop drives: one rank's trainer, or virtual ranks."""

    @property
    def step(self) -> int: ...

    def run_step(self, faults: dict[int, dict], detail: bool) -> StepSummary:
        """One optimizer step of this participant's ranks (``faults``: rank -> its fault); raises when a rank's
        step fails (the loop's exchange then fails for every participant)."""

    def skip_batch(self) -> None: ...
    def snapshot(self, keep_from: int) -> None: ...

    def save(self, path: str, async_save: bool, dir_mode: int | None) -> str | None:
        """Save (or start saving) a checkpoint into ``path`` (made with ``dir_mode`` first, when set); the failure
        of an ordinary save as ``rank N: cause``, else None. Raises when the process group broke (a peer died):
        then the window fails, not only the save."""

    def save_state(self) -> SaveState | None:
        """The asynchronous save in flight, if any: its step, whether it is written, its error."""

    def finish_save(self) -> SaveState | None:
        """Wait for the asynchronous save in flight and forget it; how it went (None: there was none)."""


class RankLoop:
    def __init__(self, stepper: Stepper, exchange: TreeExchange, desk: Desk | None = None):
        self.stepper, self.exchange, self.desk = stepper, exchange, desk
        self.phase = ("idle", 0, time.monotonic())  # (phase, step, since): what the loop is doing (``progress``)
        self._held: StepRecord | None = None  # rank 0: a step's record put after the save its boundary finished

    def _enter(self, phase: str, step: int) -> None:
        self.phase = (phase, step, time.monotonic())

    def progress(self) -> dict:
        """Where the loop is: its phase (``step``: inside the step; ``exchange``: waiting for its peers at the
        boundary; ``save``, ``snapshot``; ``idle``), of which step, for how long. A rank stuck in a step while
        its peers wait at the boundary is the one a hang is blamed on."""
        phase, step, since = self.phase
        return {"phase": phase, "step": step, "for_s": round(time.monotonic() - since, 3)}

    def run(self, window: Window) -> WindowEnd:
        """Steps until ``window.until`` or a boundary that stops or fails the window; returns how it ended. When
        it raises, rank 0 says so on its desk first: the controller learns it at once, not at its poll's end."""
        try:
            return self._run(window)
        except BaseException as exc:
            if self.desk is not None:
                self.desk.put(LoopFailed(self.stepper.step, f"{type(exc).__name__}: {exc}"[:300]))
            raise

    def _run(self, window: Window) -> WindowEnd:
        slow, live = dict(window.slow), {}
        self._progress("window", self.stepper.step)  # the first step's time counts from here
        while self.stepper.step < window.until:
            step = self.stepper.step + 1
            if self.desk is not None:
                self.desk.stepping(step)
            for _ in range(window.skips.get(step, 0)):
                self.stepper.skip_batch()
            self._enter("step", step)
            summary = self.stepper.run_step({**window.faults_at(step, slow), **live}, window.detail_due(step))
            self._enter("exchange", step)
            boundary: Boundary = self.exchange.exchange(summary, lambda merged: self._decide(merged, window))
            if boundary.failed:
                return self._end(WindowEnd(step - 1, boundary.failed), window.checkpoint)
            live = {}
            for rank, fault in boundary.faults.items():
                (slow if fault["kind"] == "slow_rank" else live)[rank] = fault
            self._keep(step, boundary, window)
            if boundary.stop:
                return self._end(WindowEnd(step, boundary.stop, boundary.preempted), window.checkpoint)
        return self._end(WindowEnd(self.stepper.step, "until"), window.checkpoint)

    def _keep(self, step: int, boundary: Boundary, window: Window) -> None:
        """What the boundary says to keep of ``step``: a finished asynchronous save, the snapshot, a checkpoint."""
        if boundary.collect is not None:  # every rank's writing is over: how it went, then rank 0 reports it
            self._finish_save(boundary.step)
            if self.desk is not None:
                self.desk.put(self._held)
        preempt = boundary.stop == "preempt"  # without checkpoints, the snapshot keeps the step for the replacement
        if window.snapshot_due(step) or (preempt and window.snapshot_every and not window.checkpoint.every):
            self._enter("snapshot", step)
            self.stepper.snapshot(boundary.keep_from)
        stopping = boundary.stop in ("stop", "preempt")
        if window.checkpoint.due(step, stopping):
            self._save(step, window.checkpoint, sync=stopping)

    # -- rank 0 ------------------------------------------------------------------------------

    def _decide(self, merged: StepSummary, window: Window) -> Boundary:
        """Rank 0, with every rank's summary of the step: the record, the controller's requests, the boundary."""
        step = merged.step
        if not merged.finite:  # nothing of this step is kept: no record, no snapshot, no save
            return Boundary(step, failed="nan_loss")
        request = self.desk.take(step)
        if request.stop == HUNG:  # the controller is diagnosing a hang: keep nothing of a step it never saw
            return Boundary(step, failed=HUNG)
        record = StepRecord(step, merged, time.time(), snapshot=window.snapshot_due(step))
        collect = merged.saving.step if merged.saving is not None and merged.saving.done else None
        if collect is None:
            self.desk.put(record)
        else:  # the finished save is reported first (``_keep``): sealed with the records up to its own step
            self._held = record
        faults = {f["rank"]: {**f, "at_step": step + 1} for f in request.faults}
        if step + 1 in window.faults or faults:  # a drill's fault next: the controller has every record first
            self.desk.wait_delivered(FAULT_SYNC_S)
        # a preemption notice (a rank's own, or its node's drain) ends the window here, saved, unless the run stops
        # here anyway
        told = tuple(sorted({*merged.preempted, *request.preempted}))
        stop = request.stop if request.stop == "stop" or not told else "preempt"
        return Boundary(step, stop=stop, faults=faults, keep_from=merged.replicated, collect=collect,
                        preempted=told if stop == "preempt" else ())

    # -- saves ---------------------------------------------------------------------------------

    def _save(self, step: int, plan: CheckpointPlan, sync: bool) -> None:
        """Every rank saves ``step`` (asynchronously unless ``sync``: a stop's save is whole before the window
        ends), after the save in flight is finished (one at a time); then one exchange of how it went."""
        self._progress("save", step)
        self._enter("save", step)
        t0 = time.perf_counter()
        async_save = plan.async_save and not sync
        finished = self.stepper.finish_save()
        error = self.stepper.save(plan.path(step), async_save, plan.dir_mode)
        outcome = SaveOutcome(step, error, finished, saved=True)
        self.exchange.exchange(outcome, lambda merged: self._report_save(merged, async_save, t0))

    def _report_save(self, merged: SaveOutcome, async_save: bool, t0: float) -> None:
        if merged.finished is not None:
            self.desk.put(SaveRecord(merged.finished.step, async_save=True, error=merged.finished.error, done=True,
                                     time=time.time()))
        if merged.saved:
            done = not async_save or merged.error is not None
            self.desk.put(SaveRecord(merged.step, async_save, merged.error, time.perf_counter() - t0, done=done,
                                     time=time.time()))

    def _end(self, end: WindowEnd, plan: CheckpointPlan) -> WindowEnd:
        """The window is over; one that ends the run (a stop, its last step) first finishes its asynchronous save,
        so the controller seals it before the run ends."""
        final = end.reason == "stop" or (end.reason == "until" and end.step == plan.last_step)
        if final and plan.async_save:
            self._progress("wait", end.step)
            self._finish_save(end.step)
        if self.desk is not None:
            self.desk.put(end)
        self._enter("idle", end.step)
        return end

    def _finish_save(self, step: int) -> None:
        """Every rank waits for its asynchronous save (a failure in its writing is known only now) and rank 0
        reports it written, or failed with the first rank's cause."""
        finished = self.stepper.finish_save()
        self.exchange.exchange(SaveOutcome(step, finished=finished),
                               lambda merged: self._report_save(merged, True, time.perf_counter()))

    def _progress(self, phase: str, step: int) -> None:
        if self.desk is not None:
            self.desk.put(Progress(phase, step, time.time()))
