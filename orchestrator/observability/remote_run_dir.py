"""A run dir in object storage (``run_dir: s3://BUCKET/runs/NAME``): written locally, copied up as whole files.

Every writer of a run dir keeps writing local files (step records line by line, the summary, TensorBoard event
files, an MLflow database or W&B offline run left at their default places, the control token), in the URL's
staging directory (`workers.storage.staging_dir`). `RunDirUpload` copies the files that changed since its last
copy to the URL: at the step a checkpoint is committed, at a step once `UPLOAD_EVERY_S` have passed, when the run
stops (a failure included) and once the summary is written. An object store has no append, so nothing is
appended to it line by line; each copy replaces whole objects, and what the bucket holds is always a complete
earlier copy of each file. A crash loses at most what was written since the last copy (the steps after the last
checkpoint, which a resume trains again). A resumed run first copies the bucket's files (its checkpoints aside)
back into the staging directory, so a controller restarted on another machine appends to the records already
uploaded instead of replacing them. The control token is a secret and stays local, and so does the run-dir lock.
"""

from __future__ import annotations

import time
from pathlib import Path

from orchestrator.api.auth import TOKEN_FILE
from orchestrator.checkpoints.dir_lock import LOCK_FILE
from orchestrator.events import event
from orchestrator.observability.observers import JobObserver, StepReport
from orchestrator.spec import JobSpec
from workers.storage import download_tree, location, upload_tree

UPLOAD_EVERY_S = 60.0  # at most this long between copies while steps run (checkpoints and the end copy too)
NEVER_UPLOADED = (TOKEN_FILE, LOCK_FILE)  # the lock is this machine's (`orchestrator.checkpoints.dir_lock`)
CHECKPOINTS = "checkpoints"  # the default checkpoint folder: DCP writes it in the bucket itself, never staged


class RunDirUpload(JobObserver):
    """Copies a run's staging directory ``local`` up to its object-store ``url``, changed files only."""

    def __init__(self, url: str, local: Path, every_s: float = UPLOAD_EVERY_S):
        self.url, self.local, self.every_s = url, local, every_s
        self.remote = location(url)
        self.sent: dict[str, tuple[int, int]] = {}
        self._last = time.monotonic()

    def pull(self) -> list[str]:
        """The bucket's copy of the run dir into the staging directory (for a resume); returns the names."""
        self.local.mkdir(parents=True, exist_ok=True)
        pulled = download_tree(self.remote, self.local, skip_dirs=(CHECKPOINTS,))
        for name in pulled:  # as they are in the bucket: no need to copy them up again
            stat = (self.local / name).stat()
            self.sent[name] = (stat.st_size, stat.st_mtime_ns)
        return pulled

    def push(self) -> list[str]:
        """Copy what changed up; a failed copy is reported and retried at the next one, never raised into the
        run (the files stay in the staging directory)."""
        self._last = time.monotonic()
        if not self.local.is_dir():
            return []
        try:
            return upload_tree(self.local, self.remote, skip=NEVER_UPLOADED, sent=self.sent)
        except Exception as exc:  # each fsspec back end raises its own (botocore, aiohttp, OSError)
            event("run_dir_upload_failed", url=self.url, error=f"{type(exc).__name__}: {exc}", kept=self.local)
            return []

    def on_step(self, report: StepReport) -> None:
        """Every ``every_s``, what changed goes up."""
        if time.monotonic() - self._last >= self.every_s:
            self.push()

    def on_checkpoint(self, blocking_s: float | None, committed: bool) -> None:
        """A committed checkpoint goes up at once, with the records up to its step: the ranks report a save after
        its step's record, so the record is written already, and a resume from it appends the steps after it."""
        if committed:
            self.push()


def run_dir_upload(spec: JobSpec) -> RunDirUpload | None:
    """The uploader of a job whose ``run_dir`` is an object-store URL; None for a local run dir."""
    url = spec.run_dir_url()
    return RunDirUpload(url, spec.resolved_run_dir()) if url is not None else None
