"""Every thread's Python stack of a rank process, on demand from outside it, even when it is frozen.

Why a signal and ``faulthandler``: a rank that hangs may be stuck where Python never runs (a collective, a
kernel, a SIGSTOP), so it cannot answer a call; ``faulthandler``'s handler is C code that writes every thread's
frames from inside the signal, whatever the threads are doing. Each rank process registers it at start
(``install``) to write into a file of its own that its node's agent can read (``dump``). A stopped process
handles no signal, so the agent continues it just long enough for the handler to write and stops it again: the
stuck rank is killed right after, as before, and nothing else changes.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import tempfile
import time
from pathlib import Path

SIGNAL = signal.SIGUSR1  # Ray and torch leave it alone in a rank process
_files: list = []  # the open dump file of this process (faulthandler writes to its descriptor)


def path_for(pid: int) -> Path:
    """The file process ``pid`` writes its stacks into (on its own node; private to the user)."""
    return Path(tempfile.gettempdir()) / f"raymesh-stacks-{os.getuid()}" / f"{pid}.txt"


def install() -> Path:
    """Have ``SIGNAL`` write this process's stacks, every thread's, into ``path_for(os.getpid())``."""
    path = path_for(os.getpid())
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _files:
        _files.append(open(path, "a", encoding="utf-8"))  # noqa: SIM115 (held open for the process's life)
        faulthandler.register(SIGNAL, file=_files[0], all_threads=True, chain=False)
    return path


def stopped(pid: int | None) -> bool:
    """Whether ``pid`` is stopped (state T in /proc; False where there is no /proc, or for None)."""
    if pid is None:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def dump(pids: dict[int, int], wait_s: float = 3.0) -> dict[int, str]:
    """Every thread's stack of each process in ``pids`` (key -> pid), as ``faulthandler`` writes it; a process
    that wrote nothing within ``wait_s`` (gone, or never installed the handler) is left out. A stopped process is
    continued until it wrote, then stopped again."""
    before, resumed = {}, []
    for key, pid in pids.items():
        before[key] = _size(path_for(pid))
        try:
            was_stopped = stopped(pid)
            os.kill(pid, SIGNAL)
            if was_stopped:
                os.kill(pid, signal.SIGCONT)
                resumed.append(pid)
        except ProcessLookupError:
            before.pop(key)
    texts = _collect({k: pids[k] for k in before}, before, wait_s)
    for pid in resumed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    return texts


def _collect(pids: dict[int, int], before: dict[int, int], wait_s: float) -> dict[int, str]:
    """What each file gained since ``before``, once it stopped growing (the handler writes in several calls)."""
    deadline, sizes = time.monotonic() + wait_s, {}
    while time.monotonic() < deadline:
        now = {k: _size(path_for(pid)) for k, pid in pids.items()}
        if all(now[k] > before[k] for k in pids) and now == sizes:
            break
        sizes = now
        time.sleep(0.05)
    out = {}
    for key, pid in pids.items():
        try:
            with open(path_for(pid), encoding="utf-8", errors="replace") as f:
                f.seek(before[key])
                text = f.read()
        except FileNotFoundError:
            continue
        if text:
            out[key] = text
    return out
