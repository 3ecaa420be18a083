"""The loop's ``Stepper`` for a real rank: its ``Trainer``, its snapshot store and its checkpoint writer.

A save's failure is told apart from a broken process group the way a failed step is (``RankStepError.of``): a
full disk or an I/O error is the save's (rank 0 reports it and training goes on), a peer lost mid-save is the
window's (it fails, and the controller recovers).
"""

from __future__ import annotations

import dataclasses
import os

from workers.diagnostics.faults import RankStepError
from workers.loop.summary import SaveState, StepSummary


class TrainerStepper:
    def __init__(self, trainer, store, take_snapshot, notice=lambda: False):
        """``notice``: whether this rank's process had a preemption notice (``RankWorker``'s SIGTERM handler)."""
        self.trainer, self.store, self._take_snapshot, self.notice = trainer, store, take_snapshot, notice

    @property
    def step(self) -> int:
        return self.trainer.step

    def run_step(self, faults: dict[int, dict], detail: bool) -> StepSummary:
        result = self.trainer.train_step(faults.get(self.trainer.rank))
        result = dataclasses.replace(result, replicated_step=self.store.replicated)
        return StepSummary.of(result, detail, self.save_state(), self.notice())

    def skip_batch(self) -> None:
        self.trainer.state.cursor.next_batch()

    def snapshot(self, keep_from: int) -> None:
        self._take_snapshot(keep_from)

    def save(self, path: str, async_save: bool, dir_mode: int | None) -> str | None:
        try:
            if dir_mode is not None:  # a local folder, private before anything is written into it
                os.makedirs(path, exist_ok=True)
                os.chmod(path, dir_mode)
            self.trainer.checkpoints.save(path, async_save)
        except Exception as exc:  # SaveFailed (CheckpointIO): the folder and the cause; an OSError making it
            return self._save_error(exc)
        return None

    def save_state(self) -> SaveState | None:
        io = self.trainer.checkpoints
        if io.pending is None:
            return None
        return SaveState(io.pending_step, io.pending.done())  # a failure is learnt by waiting (finish_save)

    def finish_save(self) -> SaveState | None:
        io = self.trainer.checkpoints
        step = io.pending_step
        if io.pending is None:
            return None
        try:
            io.wait()
        except Exception as exc:
            return SaveState(step, True, self._save_error(exc))
        return SaveState(step, True)

    def _save_error(self, exc: BaseException) -> str:
        """``rank N: saving the checkpoint PATH failed: cause`` for the record (``CheckpointIO`` names the folder
        and the rank whose write failed); a broken process group is raised instead (the window fails)."""
        if RankStepError.of(exc).kind == "peer_lost":
            raise exc
        return f"rank {self.trainer.rank}: {(str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]}"
