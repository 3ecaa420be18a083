"""Checkpoint bookkeeping on the controller side: naming, sealing, the newest loadable one, retention.

A checkpoint counts as complete once the controller has sealed it with its
checksum manifest (``orchestrator.checkpoints.checksums``), which happens only after DCP
reports the save durable; so a save interrupted half way is never picked for
resume nor counted against ``keep``. ``latest_verified`` checks the bytes
before a load: a corrupt checkpoint is moved aside to ``step-N.corrupt`` (kept
for inspection, never picked again), logged, recorded in ``skipped``, and the
previous one is used. ``root`` may be an object-store URL (`workers.storage`).

A checkpoint saved at a step that scored the held-out loss (``eval.every``) carries it in ``eval.json``, written
before the seal so the checksums cover it; ``best`` is the complete one with the lowest, which retention spares
under ``checkpoint.keep_best``. The batches a repeated NaN made the run skip are at the root (``SKIPPED``), for a
resume to skip them again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from orchestrator.checkpoints import checksums
from orchestrator.observability.events import event
from workers.storage import location, move_tree, remove_tree

# at least 8 digits: `step:08d` pads to eight and writes step 100,000,000 and beyond with more
_NAME = re.compile(r"^step-(\d{8,})$")
_LEFTOVER = re.compile(r"^step-(\d{8,})(\.corrupt)?$")
SCORE = "eval.json"  # {"step", "eval_loss"}: the held-out loss of the weights a checkpoint holds
SKIPPED = "skipped_batches.json"  # {"skip_batches": {step: n}}: batches skipped before a step (repeated NaN)


class CheckpointDir:
    def __init__(self, root: str | Path, keep: int, on_skip: Callable[[dict], None] | None = None,
                 keep_best: bool = False):
        self.root = location(root)
        self.keep = keep
        self.keep_best = keep_best
        self.on_skip = on_skip
        self.skipped: list[dict] = []  # corrupt or incomplete checkpoints passed over, for the summary

    def path_for(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    @staticmethod
    def step_of(path: Path) -> int:
        """The step the checkpoint folder ``path`` (a ``path_for``) holds."""
        return int(_NAME.match(path.name).group(1))

    def seal(self, step: int) -> None:
        """Write the checksum manifest of a save DCP reported durable; only then is it complete."""
        checksums.write_manifest(self.path_for(step))

    def record_score(self, step: int, eval_loss: float) -> None:
        """The held-out loss of the weights saved at ``step``, beside them (call before ``seal``)."""
        (self.path_for(step) / SCORE).write_text(json.dumps({"step": step, "eval_loss": eval_loss}))

    def score(self, step: int) -> float | None:
        """The held-out loss ``step``'s checkpoint was saved with, if that step scored one."""
        path = self.path_for(step) / SCORE
        return json.loads(path.read_text())["eval_loss"] if path.is_file() else None

    def best(self, upto: int | None = None) -> int | None:
        """The complete checkpoint (at or before ``upto``) with the lowest held-out loss, the earliest of equals;
        None when none has one."""
        scored = [(loss, step) for step in self.complete_steps() if upto is None or step <= upto
                  if (loss := self.score(step)) is not None]
        return min(scored)[1] if scored else None

    def record_skipped_batches(self, skips: dict[int, int]) -> None:
        """The batches skipped before each step (``TrainingJob.skip_batches``), at the root as soon as one is, not
        in the next save: a resume from the checkpoint before the skip must skip them too, and the next save may
        never come. A later checkpoint's data position is past them already (a resume skips only steps ahead)."""
        self.root.mkdir(parents=True, exist_ok=True)
        checksums.write_json(self.root / SKIPPED, {"skip_batches": {str(k): n for k, n in skips.items()}})

    def skipped_batches(self) -> dict[int, int]:
        """What ``record_skipped_batches`` wrote; none in a directory from before it was written."""
        path = self.root / SKIPPED
        if not path.is_file():
            return {}
        return {int(k): n for k, n in json.loads(path.read_text())["skip_batches"].items()}

    def forget_skipped_batches(self) -> None:
        """A fresh run's data skips nothing an earlier run in this directory skipped."""
        (self.root / SKIPPED).unlink(missing_ok=True)

    def complete_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        steps = []
        for child in self.root.iterdir():
            m = _NAME.match(child.name)
            if m and (child / checksums.MANIFEST).is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest(self) -> Path | None:
        steps = self.complete_steps()
        return self.path_for(steps[-1]) if steps else None

    def latest_verified(self, purpose: str) -> Path | None:
        """The newest checkpoint whose files match their manifest; corrupt newer ones are moved aside."""
        for step in reversed(self.complete_steps()):
            path = self.path_for(step)
            why = checksums.problem(path)
            if why is None:
                return path
            aside = path.with_name(path.name + ".corrupt")
            remove_tree(aside)
            move_tree(path, aside)
            record = {"step": step, "path": str(aside), "problem": why, "found_by": purpose}
            self.skipped.append(record)
            event("checkpoint_corrupt", step=step, problem=repr(why), moved_to=aside, found_by=purpose,
                  action="using the previous checkpoint")
            if self.on_skip is not None:
                self.on_skip(record)
        return None

    def prune(self, newest: int) -> list[int]:
        """Delete complete checkpoints beyond the ``keep`` newest up to ``newest`` (the step just committed);
        return the steps removed.

        Steps after ``newest`` are left alone: they are not this run's lineage (the run being trained
        never saved past its current step), so they can neither push its own checkpoints out of the
        window nor be deleted by it. Under ``keep_best`` the best checkpoint up to ``newest`` stays too.
        """
        best = self.best(newest) if self.keep_best else None
        old = [s for s in [s for s in self.complete_steps() if s <= newest][: -self.keep] if s != best]
        for step in old:
            remove_tree(self.path_for(step))
        self.remove_leftovers(newest)
        return old

    def remove_leftovers(self, newest: int | None = None) -> list[Path]:
        """Delete what can never be loaded, with a log line each: saves that never completed (no manifest) and
        checkpoints set aside as corrupt, older than the oldest complete checkpoint kept (newer ``.corrupt``
        folders stay for inspection until retention passes them). ``newest``: the step just committed
        (a save after it may be in flight and is left alone); None at start-up, when nothing is in flight."""
        kept = self.complete_steps()
        oldest = kept[0] if kept else None
        removed = []
        for child in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            m = _LEFTOVER.match(child.name)
            if not m or not child.is_dir():
                continue
            step, corrupt = int(m.group(1)), bool(m.group(2))
            partial = not corrupt and step not in kept and (newest is None or step < newest)
            if partial or (corrupt and oldest is not None and step < oldest):
                remove_tree(child)
                removed.append(child)
                event("checkpoint_removed", path=child, why="corrupt, older than every kept checkpoint" if corrupt
                      else "incomplete save (no manifest): it can never be loaded")
        return removed
