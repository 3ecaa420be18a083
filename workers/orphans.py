"""Folders a process makes for itself and a later process removes should the first be killed (SIGKILL, or SIGTERM,
which runs no clean-up): the maker's pid and host are in the folder's name, so only a folder whose maker is gone
is removed, and never one made on another host of a shared file system, whose pids this host cannot see.

Torch-free: `prepare-data` (its staging folders) and the ranks (NVMe offload files) both use it.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path


def owned_prefix(prefix: str) -> str:
    """``prefix`` plus this process's pid and host, for ``tempfile.mkdtemp(prefix=...)``."""
    return f"{prefix}{os.getpid()}@{socket.gethostname()}-"


def remove_orphans(root: Path, prefix: str) -> list[Path]:
    """Delete the folders under ``root`` named ``prefix`` + an owner (`owned_prefix`'s, or a bare pid: made on
    this host) + ``-`` + a random suffix whose owning process is gone; returns them. A folder whose pid is alive
    (or reused), of another host, or named otherwise, is left alone."""
    removed = []
    for child in root.glob(f"{prefix}*-*") if root.is_dir() else []:
        pid, _, host = child.name[len(prefix):].rpartition("-")[0].partition("@")
        if not child.is_dir() or not pid.isdigit() or host not in ("", socket.gethostname()) or _alive(int(pid)):
            continue
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
    return removed


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one of another user counts: signalling it is refused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
