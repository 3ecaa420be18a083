"""Checkpoint bookkeeping on the controller side: naming, the latest complete one, retention.

A checkpoint directory counts as complete once DCP has written its
``.metadata`` file (the coordinator writes it last), so a save interrupted
half way is never picked for resume nor counted against ``keep``.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

_NAME = re.compile(r"^step-(\d{8})$")


class CheckpointDir:
    def __init__(self, root: str | Path, keep: int):
        self.root = Path(root)
        self.keep = keep

    def path_for(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def complete_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        steps = []
        for child in self.root.iterdir():
            m = _NAME.match(child.name)
            if m and (child / ".metadata").is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest(self) -> Path | None:
        steps = self.complete_steps()
        return self.path_for(steps[-1]) if steps else None

    def prune(self) -> list[int]:
        """Delete complete checkpoints beyond the newest ``keep``; return the steps removed."""
        old = self.complete_steps()[: -self.keep]
        for step in old:
            shutil.rmtree(self.path_for(step), ignore_errors=True)
        return old
