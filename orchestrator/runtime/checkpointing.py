"""The checkpoint cadence of a running job: when to save, at most one asynchronous save in flight, sealing.

The ranks save on their own inside a window of steps (``plan``, ``workers.loop``) and report each save written
or failed (``on_save``); the controller saves between windows only where it must: a parameter-server job (its
shards' part goes into the same folder while they are quiet), a save a failure cut short, a resize, and the last
step when its save failed. A save is complete only once its checksum manifest is written (``seal``): at once
for a synchronous save, and for an asynchronous one when every rank has it written. ``saved`` lists the
committed checkpoints the summary reports. A save of a step that scored the held-out loss gets that loss
beside it before the seal (``CheckpointDir.record_score``), which ``checkpoint.keep_best`` and
``--checkpoint best`` go by; every save gets the job fields its tensors are read by
(``orchestrator.checkpoints.job_record``), which a resume or an export checks before it starts.

A save that fails mid-run is said (``checkpoint_failed``, with the rank's own error: the cause and the folder) and
training goes on; when the run's last save fails too, ``not_kept`` says which steps are not on disk, and the run
ends ``failed`` (``TrainingJob._loop``): its product, the trained weights, was not kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from orchestrator.checkpoints import job_record
from orchestrator.checkpoints.directory import CheckpointDir
from orchestrator.events import event
from orchestrator.observability.observers import JobObserver
from orchestrator.runtime.group import StepFailed
from orchestrator.spec import JobSpec
from workers.loop.plan import CheckpointPlan, SaveRecord


class Checkpointing:
    def __init__(self, spec: JobSpec, ckpt: CheckpointDir, observers: JobObserver):
        self.every = spec.checkpoint.every
        self.async_save = spec.checkpoint.async_save
        self.total_steps = spec.train.steps
        self.ckpt = ckpt
        self.observers = observers
        self.saved: list[str] = []
        self.in_flight: int | None = None  # the step of an async save not yet sealed
        self.scores: dict[int, float] = {}  # step -> held-out loss, for the saves of steps that evaluated
        self.beside_ranks: Callable[[Path], None] | None = None  # writes the PS shards' part into a save's folder
        self.record = job_record.record(spec)  # what the saves' tensors are read by (a resize changes only dp)
        self.not_kept: dict | None = None  # the run's last save failed: what is not on disk (``finish``)
        self.blocked_s = 0.0  # seconds the ranks' saves held their loop since the last step record

    def plan(self, first: int, until: int, in_window: bool) -> CheckpointPlan:
        """What the ranks of a window of steps ``first``..``until`` save on their own (nothing when ``in_window``
        is false: the controller saves). The saves due in it are this process's from now on (``expect``: a
        failed try's leftovers go before any rank writes there); a stop's save is, once it starts (``saving``)."""
        if not in_window or not self.every:
            return CheckpointPlan()
        due = {*range(-(-first // self.every) * self.every, until + 1, self.every), self.total_steps}
        for step in sorted(s for s in due if first <= s <= until):
            self.ckpt.expect(step)
        self.ckpt.make_root()
        modes = self.ckpt.modes
        return CheckpointPlan(self.every, self.async_save, self.total_steps, self.ckpt.path_pattern(),
                              modes[0] if modes is not None else None)

    def saving(self, step: int) -> None:
        """The ranks started saving ``step`` inside their window: this process's save, until sealed."""
        self.ckpt.writing.add(step)

    def on_save(self, record: SaveRecord, final: bool = False) -> None:
        """A save the ranks made inside their window: sealed once every rank has it written, reported when a rank
        failed it: training goes on and the next save tries again, or, for the step the run ends at (``final``),
        ``finish`` saves it again."""
        if record.error is not None:
            if self.in_flight == record.step:
                self.in_flight = None
            then = "saving it again, synchronously" if final else "training goes on; the next save tries again"
            event("checkpoint_failed", step=record.step, reason=record.error.splitlines()[0][:300], action=then)
            return
        if record.async_save and record.done:  # an asynchronous save written everywhere
            self.in_flight = None
            self.committed(record.step, None)
            return
        self.blocked_s += record.seconds
        self.observers.on_checkpoint(record.seconds, committed=False)
        if record.async_save:
            self.in_flight = record.step
        else:
            self.committed(record.step, record.seconds)

    def take_blocked(self) -> float:
        """The seconds saves held the ranks since the last step record (the next record's ``checkpoint`` phase)."""
        blocked, self.blocked_s = self.blocked_s, 0.0
        return blocked

    def due(self, step: int, stopping: bool) -> bool:
        """Every ``checkpoint.every`` steps, at the last step and when stopping (checkpoints on only)."""
        return bool(self.every) and (step % self.every == 0 or step == self.total_steps or stopping)

    def scored(self, step: int, eval_loss: float | None) -> None:
        """``step``'s held-out loss (None: it did not evaluate), for a save of that step to carry."""
        if eval_loss is None:
            self.scores.pop(step, None)  # a step trained again after a rollback scores as it did, or not at all
        else:
            self.scores[step] = eval_loss

    def save(self, group, step: int) -> float:
        """Issue a save; return the seconds training was blocked by it.

        A save that raises on a rank (disk full, an I/O error) is logged and skipped: training goes on and the
        next save tries again (what is left of it is removed as incomplete). A rank lost meanwhile raises
        ``StepFailed`` (``RankGroup.call``) and is recovered from like a failed step."""
        t0 = time.perf_counter()
        try:
            if self.async_save:
                self.wait_async(group)  # at most one save in flight; commit the previous one first
            self.ckpt.begin(step)
            self._save_beside_ranks(step)
            group.call("save_checkpoint", str(self.ckpt.path_for(step)), self.async_save)
        except StepFailed:
            raise
        except Exception as exc:
            self.in_flight = None
            event("checkpoint_failed", step=step, reason=_reason(exc),
                  action="training goes on; the next save tries again")
            return time.perf_counter() - t0
        blocked = time.perf_counter() - t0
        self.observers.on_checkpoint(blocked, committed=False)
        if self.async_save:
            self.in_flight = step
        else:
            self.committed(step, blocked)
        return blocked

    def wait_async(self, group, then: str = "training goes on; the next save tries again") -> int | None:
        """Commit the async save in flight once every rank has it written; return its step.

        One that failed in the background (disk full, an I/O error) is logged and forgotten like a failed
        synchronous save (its leftovers are removed as incomplete), so what comes next (the next save, the end
        of the run, a re-formed grid) goes on (``then`` says how, in the event); it returns None then. A rank lost
        meanwhile raises ``StepFailed``."""
        step = self.in_flight
        try:
            done = group.call("wait_checkpoint")
        except StepFailed:
            raise  # still in flight: the recovery's ``forget_in_flight`` learns which save was cut short
        except Exception as exc:
            self.in_flight = None
            event("checkpoint_failed", step=step if step is not None else "-", reason=_reason(exc), action=then)
            return None
        self.in_flight = None
        if done[0] is not None:
            self.committed(done[0], None)
        return done[0]

    def finish(self, group, step: int) -> None:
        """At the end of the run: commit the save in flight, then, unless ``step`` (the one the run ends at) is
        complete on disk, save it synchronously: its save failed, or lost a rank whose recovery restored the step
        (a stop's save too), and no later save would; else the run would end without the checkpoint of its last
        step."""
        try:
            self.save_now(group, step, then="saving it again, synchronously")
        except StepFailed:
            raise
        except Exception as exc:
            self.not_kept = self._not_kept(step, _reason(exc))
            event("checkpoint_failed", step=step, reason=self.not_kept["reason"],
                  action="the run ends without it: it fails", not_kept=self.not_kept["steps_not_kept"])
            self.ckpt.remove_leftovers()  # nothing is in flight: what the failed saves left frees its space

    def _not_kept(self, step: int, reason: str) -> dict:
        """The summary's ``checkpoint_failure``: the last save (of ``step``) failed for ``reason``; the newest
        checkpoint on disk and the steps after it, which are not."""
        on_disk = max((s for s in self.ckpt.complete_steps() if s <= step), default=None)
        first = (on_disk or 0) + 1
        return {"step": step, "reason": reason, "last_on_disk": on_disk,
                "last_checkpoint": str(self.ckpt.path_for(on_disk)) if on_disk is not None else None,
                "steps_not_kept": f"{first}-{step}" if first < step else str(step)}

    def poll(self, group) -> None:
        """Seal an async save as soon as every rank has it durable, so a failure before the next save can
        fall back to it (with ``every: 50``, waiting for the next save would leave it unsealed 50 steps)."""
        if self.in_flight is not None and all(group.call("checkpoint_durable")):
            self.wait_async(group)  # returns at once: every rank's save is done

    def forget_in_flight(self, reached: int) -> int | None:
        """The grid is formed again (recovery, resize): its ranks' unfinished save dies with the old group.
        Returns that save's step, so a recovery that restores exactly that step can save it again. First, the
        saves the ranks finished in the window whose report died with rank 0 (``adopt_finished``)."""
        self.adopt_finished(reached)
        step, self.in_flight = self.in_flight, None
        return None if step in self.ckpt.complete_steps() else step

    def adopt_finished(self, reached: int) -> list[int]:
        """Seal the in-window saves of this process, up to step ``reached`` (the last one the controller has a
        record of), that every rank finished though their report was lost with rank 0's desk: DCP writes a save's
        ``.metadata`` only once every rank's data is written, so a folder holding it is whole. Returns the steps."""
        adopted = []
        for step in sorted(s for s in self.ckpt.writing if s <= reached and s not in self.ckpt.complete_steps()):
            if (self.ckpt.path_for(step) / ".metadata").exists():
                self.committed(step, None)
                adopted.append(step)
        return adopted

    def save_now(self, group, step: int, then: str = "training goes on; the next save tries again") -> None:
        """A synchronous save of ``step`` unless it is on disk complete already (before the grid is torn down, and
        at the end); ``then``: what follows an async save in flight that failed (``wait_async``)."""
        self.wait_async(group, then)
        if step not in self.ckpt.complete_steps():  # not ``saved``: that save may have been found corrupt since
            path = self.ckpt.begin(step)
            self._save_beside_ranks(step)
            group.call("save_checkpoint", str(path), False)
            self.committed(step, None)

    def _save_beside_ranks(self, step: int) -> None:
        """The parameter-server shards' state goes into the same folder first (synchronously: the shards are
        quiet between steps), so the manifest that seals the ranks' save covers it too."""
        if self.beside_ranks is not None:
            self.beside_ranks(self.ckpt.path_for(step))

    def committed(self, step: int, seconds: float | None) -> None:
        path = str(self.ckpt.path_for(step))
        if path in self.saved:  # saved again after a rollback to before it (it was corrupt, or its save cut short)
            self.saved.remove(path)
        self.saved.append(path)
        if step in self.scores:
            self.ckpt.record_score(step, self.scores[step])
        job_record.write(self.ckpt.path_for(step), self.record)
        self.ckpt.seal(step)
        removed = self.ckpt.prune(step)
        self.observers.on_checkpoint(None, committed=True)
        event("checkpoint", step=step, path=self.ckpt.path_for(step),
              seconds="async" if seconds is None else f"{seconds:.2f}", pruned=removed or "-")


def _reason(exc: BaseException) -> str:
    """A failed save's error as one line for its ``checkpoint_failed`` event: the rank's own exception (Ray wraps it
    in a ``RayTaskError`` whose text starts with the actor's repr; its ``cause`` is the rank's error, which names
    the folder and the cause, e.g. "No space left on device")."""
    while getattr(exc, "cause", None) is not None and exc.cause is not exc:
        exc = exc.cause
    text = (str(exc).strip().splitlines() or [""])[0]
    return text[:300] if text else type(exc).__name__
