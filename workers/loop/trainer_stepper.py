"""The loop's ``Stepper`` for a real rank: its ``Trainer``, its snapshot store and its checkpoint writer.

A save's failure is told apart from a broken process group the way a failed step is (``RankStepError.of``): a
full disk or an I/O error is the save's (rank 0 reports it and training goes on), a peer lost mid-save is the
window's (it fails, and the controller recovers).
"""

from __future__ import annotations

import dataclasses

from torch.distributed.checkpoint.api import CheckpointException

from workers.diagnostics.faults import RankStepError
from workers.loop.summary import SaveState, StepSummary


class TrainerStepper:
    def __init__(self, trainer, store, take_snapshot):
        self.trainer, self.store, self._take_snapshot = trainer, store, take_snapshot

    @property
    def step(self) -> int:
        return self.trainer.step

    def run_step(self, faults: dict[int, dict], detail: bool) -> StepSummary:
        result = self.trainer.train_step(faults.get(self.trainer.rank))
        result = dataclasses.replace(result, replicated_step=self.store.replicated)
        return StepSummary.of([result], self.save_state())

    def skip_batch(self) -> None:
        self.trainer.state.cursor.next_batch()

    def snapshot(self, keep_from: int) -> None:
        self._take_snapshot(keep_from)

    def save(self, path: str, async_save: bool) -> str | None:
        try:
            self.trainer.checkpoints.save(path, async_save)
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            return self._save_error(exc, path)
        return None

    def save_state(self) -> SaveState | None:
        io = self.trainer.checkpoints
        if io.pending is None:
            return None
        done = io.pending.done()
        failed = done and io.pending.exception() is not None
        return SaveState(io.pending_step, done, self._save_error(io.pending.exception(), io.pending_path)
                         if failed else None)

    def finish_save(self) -> SaveState | None:
        io = self.trainer.checkpoints
        step, path = io.pending_step, io.pending_path
        if io.pending is None:
            return None
        try:
            io.wait()
        except (Exception, CheckpointException) as exc:
            return SaveState(step, True, self._save_error(exc, path))
        return SaveState(step, True)

    def _save_error(self, exc: BaseException, path: str | None) -> str:
        """``rank N: writing PATH: cause`` for the record, naming the rank whose write failed (DCP gathers every
        rank's failure into one exception); a broken process group is raised instead (the window fails)."""
        failures = getattr(exc, "failures", None)
        if failures:
            rank, (cause, _trace) = min(failures.items())
            return f"rank {rank}: writing {path}: {type(cause).__name__}: {cause}"
        error = RankStepError.of(exc)
        if error.kind == "peer_lost":
            raise exc
        return f"rank {self.trainer.rank}: writing {path}: {error.detail}"
