"""One run at a time in a run dir: an exclusive lock the controller holds for its whole life.

Two ``raymesh run``s of one job under different ``--id``s used to train into the same run dir and checkpoint
folders, each overwriting the other's records (one run's ``steps.jsonl`` was lost) and checkpoints. Now the
controller takes ``flock`` on ``LOCK_FILE`` in the run dir (and in ``checkpoint.dir`` when that is elsewhere)
before anything else and keeps it until it returns; a second run is refused at once, naming the holder
(its job, pid, host and since when, which the holder writes into the file). ``raymesh run`` probes the same locks
before it starts Ray.

Why ``flock``: the kernel drops it when its process dies, however it dies, so a controller that Ray restarts takes
it again with no stale lock to clean up, and a lock file is never deleted (deleting one races with a process that
opened it). On NFS, Linux emulates ``flock`` with byte-range locks the server arbitrates, so it holds across hosts;
there a dead host's lock lasts until the server's lease ends (90 s by default), which a restarted controller of the
same job waits out (``RESTART_WAIT_S``). Object storage has no locks: a run dir at a URL is locked in its local
staging directory, and a ``checkpoint.dir`` at a URL in a local folder named for it (``workers.storage.
staging_dir``): two runs on one machine are refused, two on different machines are not detected.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

from orchestrator.errors import SpecError
from workers.storage import is_url, staging_dir

LOCK_FILE = "raymesh.lock"
RESTART_WAIT_S = 120.0  # longer than an NFS server's default lease (90 s), after which a dead host's lock is freed
_POLL_S = 1.0
_held: dict[str, dict] = {}  # lock files this process holds -> their holder (a second take in one process fails too)


class DirBusy(SpecError):
    """Another run holds the run dir (or checkpoint dir)."""


def lock_dirs(spec) -> list[tuple[str, Path]]:
    """(field, local folder) of each lock a run of ``spec`` takes: the run dir (its staging folder for a URL), and
    ``checkpoint.dir`` when set outside it (a folder named for it when it is a URL)."""
    run_dir = spec.resolved_run_dir().absolute()
    dirs = [("run_dir", run_dir)]
    ckpt = spec.checkpoint.dir
    if ckpt is not None:
        local = staging_dir(ckpt) if is_url(ckpt) else spec.checkpoint_dir().absolute()
        if not local.is_relative_to(run_dir):
            dirs.append(("checkpoint.dir", local))
    return dirs


class DirLocks:
    """The locks of one run's folders, taken together (``acquire``) and given back together (``release``)."""

    def __init__(self, spec, job: str, modes: tuple[int, int] | None = None):
        self.dirs = lock_dirs(spec)
        self.job, self.modes = job, modes
        self._fds: dict[str, int] = {}

    def acquire(self, wait_s: float = 0.0) -> None:
        """Take every lock, or none: ``DirBusy`` naming the holder of the first one held elsewhere. ``wait_s``: how
        long to wait for a holder of this same job (this controller's previous life, on a host that died)."""
        me = {"job": self.job, "pid": os.getpid(), "host": socket.gethostname(),
              "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        try:
            for field, folder in self.dirs:
                self._take(field, folder, me, time.monotonic() + wait_s)
        except BaseException:
            self.release()
            raise

    def _take(self, field: str, folder: Path, me: dict, deadline: float) -> None:
        path = folder / LOCK_FILE
        while True:
            holder = _held.get(str(path))
            fd = None if holder else _try_lock(path, folder, self.modes)
            if fd is not None:
                break
            holder = holder or _holder(path)
            if holder.get("job") != self.job or time.monotonic() >= deadline:
                raise _busy(field, folder, path, holder)
            time.sleep(_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        self._fds[str(path)] = fd
        _held[str(path)] = me

    def release(self) -> None:
        """Give every lock taken back (the files stay: deleting one would race with a process opening it)."""
        for path, fd in self._fds.items():
            _held.pop(path, None)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self._fds.clear()


def check_free(spec) -> None:
    """``DirBusy`` when another run holds a lock ``spec``'s run would take (``raymesh run``, before Ray starts);
    takes nothing and writes nothing."""
    for field, folder in lock_dirs(spec):
        path = folder / LOCK_FILE
        holder = _held.get(str(path))
        if holder is None and path.is_file():
            holder = _probe(path)
        if holder is not None:
            raise _busy(field, folder, path, holder)


def _probe(path: Path) -> dict | None:
    """The holder of the lock file ``path``, None when it is free (or cannot be opened to tell: the controller's
    own take will say)."""
    try:
        fd = os.open(path, os.O_RDWR)  # read-write: NFS emulates an exclusive flock with a write lock
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _holder(path)
    finally:
        os.close(fd)  # closing drops a lock taken just now


def _try_lock(path: Path, folder: Path, modes: tuple[int, int] | None) -> int | None:
    """The open, locked lock file; None when another open file holds it. Makes ``folder`` (private under
    ``modes``) when it is not there yet: the lock is the first thing a run writes."""
    if not folder.exists():
        folder.mkdir(parents=True, exist_ok=True)
        if modes is not None:
            folder.chmod(modes[0])
    fd = os.open(path, os.O_RDWR | os.O_CREAT, modes[1] if modes is not None else 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _holder(path: Path) -> dict:
    """What the holder wrote into ``path`` (nothing yet while it starts)."""
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _busy(field: str, folder: Path, path: Path, holder: dict) -> DirBusy:
    who = (f"job {holder['job']} (pid {holder['pid']} on host {holder['host']}, since {holder['since']})"
           if {"job", "pid", "host", "since"} <= holder.keys() else "a process that has not said who it is yet")
    stop = f"`raymesh stop {holder['job']}`" if "job" in holder else "its `raymesh stop`"
    return DirBusy(field, str(folder), f"is in use by another run: {who} holds {path}",
                   f"wait for that run to end or stop it ({stop}), or give this run another {field} "
                   f"(--set {field}=...)")
