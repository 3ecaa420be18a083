"""Checkpoint bookkeeping on the controller side: naming, sealing, the newest loadable one, retention.

A checkpoint counts as complete once the controller has sealed it with its
checksum manifest (``orchestrator.checkpoints.checksums``), which happens only after DCP
reports the save durable; so a save interrupted half way is never picked for
resume nor counted against ``keep``. ``latest_verified`` checks the bytes
before a load: a corrupt checkpoint is moved aside to ``step-N.corrupt`` (kept
for inspection, never picked again), logged, recorded in ``skipped``, and the
previous one is used. ``root`` may be an object-store URL (`workers.storage`).

Nothing here deletes a folder this process did not write: only a save this process started (``begin``) and that
never completed is removed as incomplete. Any other unsealed ``step-N`` (a save of an earlier life cut short, a
copy that lost its manifest, another tool's folder) is set aside by ``set_aside_unsealed`` as
``step-N.unsealed``, and set-aside folders (``.corrupt``, ``.unsealed``) are never removed automatically: they
may be the only copy of weights someone wants, and the event that set them aside names them.

Under ``checkpoint.permissions`` (``MODES``) the step folders are made 0700 before the ranks write into them and
every file is made 0600 before the seal (DCP's writers create theirs under the rank's umask).

A checkpoint saved at a step that scored the held-out loss (``eval.every``) carries it in ``eval.json``, written
before the seal so the checksums cover it; ``best`` is the complete one with the lowest, which retention spares
under ``checkpoint.keep_best``. The batches a repeated NaN made the run skip are at the root (``SKIPPED``), for a
resume to skip them again.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

from orchestrator.checkpoints import checksums
from orchestrator.events import event
from workers.storage import is_url, location, move_tree, remove_tree

# at least 8 digits: `step:08d` pads to eight and writes step 100,000,000 and beyond with more
_NAME = re.compile(r"^step-(\d{8,})$")
_ANY_STEP = re.compile(r"^step-\d{8,}")  # a checkpoint folder, sealed, unsealed or set aside (`.corrupt`, ...)
# checkpoint.permissions -> (directory mode, file mode); None: as the process's umask leaves them
MODES: dict[str, tuple[int, int] | None] = {"private": (0o700, 0o600), "group": (0o750, 0o640), "umask": None}
SCORE = "eval.json"  # {"step", "eval_loss"}: the held-out loss of the weights a checkpoint holds
SKIPPED = "skipped_batches.json"  # {"skip_batches": {step: n}}: batches skipped before a step (repeated NaN)


class CheckpointDir:
    def __init__(self, root: str | Path, keep: int, on_skip: Callable[[dict], None] | None = None,
                 keep_best: bool = False, permissions: str = "umask"):
        self.root = location(root)
        self.keep = keep
        self.keep_best = keep_best
        self.on_skip = on_skip
        self.skipped: list[dict] = []  # corrupt or incomplete checkpoints passed over, for the summary
        self.local = not is_url(self.root)  # an object store has neither folders to make nor modes
        self.modes = MODES[permissions] if self.local else None
        self.writing: set[int] = set()  # steps whose save this process started and has not sealed

    def path_for(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def path_pattern(self) -> str:
        """``path_for`` with a ``{step}`` field: the ranks name the folders they save into inside a window."""
        return str(self.root / "step-{step:08d}")

    @staticmethod
    def step_of(path: Path) -> int:
        """The step the checkpoint folder ``path`` (a ``path_for``) holds."""
        return int(_NAME.match(path.name).group(1))

    def make_root(self) -> None:
        """The checkpoint directory, made (with ``checkpoint.permissions``' mode) if it is not there yet; one that
        exists keeps its mode: it may be a folder the user shares on purpose (the step folders are still private)."""
        if self.local and not self.root.exists():
            self._mkdir(self.root, parents=True)

    def begin(self, step: int) -> Path:
        """A save of ``step`` by this process is about to start: its folder is made (private before the ranks write
        into it) once ``expect`` has cleared the way."""
        path = self.expect(step)
        self.make_root()
        self._mkdir(path)
        return path

    def expect(self, step: int) -> Path:
        """A save of ``step`` by this process will start (now, or inside a window of the ranks' own steps, which
        make the folder themselves): until it is sealed it is this process's to remove if it never completes.
        What a failed try of the same step left is removed first; an unsealed folder of that step this process
        did not write is set aside, never written into. Call it before any rank may write there."""
        path = self.path_for(step)
        if path.exists() and step not in self.complete_steps():
            if step in self.writing:
                remove_tree(path)
            else:
                self._set_aside(path, "unsealed", "it has no manifest and this run did not write it")
        self.writing.add(step)
        return path

    def _mkdir(self, path: Path, parents: bool = False) -> None:
        """``path`` made, with the private mode when ``checkpoint.permissions`` asks (set outright: mkdir's mode
        goes through the umask); nothing in an object store, where DCP's writer makes the prefix."""
        if not self.local:
            return
        path.mkdir(parents=parents, exist_ok=True)
        if self.modes is not None:
            path.chmod(self.modes[0])

    def seal(self, step: int) -> None:
        """Write the checksum manifest of a save DCP reported durable; only then is it complete. Every file in it
        gets ``checkpoint.permissions``' mode first (the ranks' DCP writers made them under their umask), the
        manifest too."""
        path = self.path_for(step)
        self._restrict(path)
        manifest = checksums.write_manifest(path)
        if self.modes is not None:
            manifest.chmod(self.modes[1])
        self.writing.discard(step)

    def _restrict(self, folder: Path) -> None:
        """Every folder and file under ``folder`` (itself too) to the private modes; nothing under a URL."""
        if self.modes is None:
            return
        folder.chmod(self.modes[0])
        for child in folder.rglob("*"):
            child.chmod(self.modes[0] if child.is_dir() else self.modes[1])

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
            aside = self._aside(path, "corrupt")
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
        """Delete the saves this process started that never completed (a rank's error, a rank lost meanwhile),
        with a log line each: they can never be loaded. ``newest``: the step just committed (a save after it may
        be in flight and is left alone); None when nothing is in flight (start-up, the run's end). A folder this
        process did not start writing is never deleted here (``set_aside_unsealed``)."""
        complete = set(self.complete_steps())
        removed = []
        for step in sorted(self.writing):
            if step in complete or (newest is not None and step >= newest):
                continue
            self.writing.discard(step)
            path = self.path_for(step)
            if path.exists():
                remove_tree(path)
                removed.append(path)
                event("checkpoint_removed", path=path, why="this run's save of it did not complete: it can "
                      "never be loaded")
        return removed

    def set_aside_unsealed(self) -> list[Path]:
        """Rename every ``step-N`` without a manifest that this process is not writing to ``step-N.unsealed``
        (a resume's start-up): never loadable as it is, yet it may hold every shard (a copy that dropped the
        manifest, a save of an earlier life cut short after its data was written), so it is kept and said."""
        complete = set(self.complete_steps())
        aside = []
        for child in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            m = _NAME.match(child.name)
            if m and child.is_dir() and int(m.group(1)) not in complete | self.writing:
                aside.append(self._set_aside(child, "unsealed", "it has no manifest (a save cut short, or a copy "
                                             "or folder raymesh did not seal)"))
        return aside

    def _set_aside(self, path: Path, tag: str, why: str) -> Path:
        """Move ``path`` out of the way under a ``tag`` name, with an event naming both and ``why``."""
        aside = self._aside(path, tag)
        move_tree(path, aside)
        event("checkpoint_set_aside", path=path, moved_to=aside, why=why,
              action="kept for inspection, never loaded nor removed by raymesh; delete it when it is not needed")
        return aside

    @staticmethod
    def _aside(path: Path, tag: str) -> Path:
        """``step-N.<tag>``, or when an earlier one took that name, ``step-N.<tag>-<UTC time>[-k]``: setting a
        folder aside never replaces one set aside before."""
        aside = path.with_name(f"{path.name}.{tag}")
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        k = 1
        while aside.exists():
            aside = path.with_name(f"{path.name}.{tag}-{stamp}" + (f"-{k}" if k > 1 else ""))
            k += 1
        return aside

    def entries(self) -> dict[str, list[str]]:
        """Every checkpoint folder under the root by kind: ``sealed``, ``unsealed`` (``step-N`` without a
        manifest), ``set_aside`` (``step-N.corrupt``, ``step-N.unsealed``, ...); names only."""
        found: dict[str, list[str]] = {"sealed": [], "unsealed": [], "set_aside": []}
        complete = {self.path_for(s).name for s in self.complete_steps()}
        for child in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            if not _ANY_STEP.match(child.name):
                continue
            kind = "sealed" if child.name in complete else "unsealed" if _NAME.match(child.name) else "set_aside"
            found[kind].append(child.name)
        return found
