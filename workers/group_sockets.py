"""Leaving a broken gloo process group at once, so that peers blocked on this rank fail now, not at the timeout.

Why: when a rank dies, only the peers in a collective *with it* fail at once (gloo sees the socket close);
a peer blocked on a *survivor* that already left its collective waits out the collective timeout, because
gloo cannot abort a pending operation (neither ``ProcessGroup.abort()`` nor ``shutdown()`` unblocks it on
torch 2.13, nor does destroying a group the model and mesh still hold). What a peer does see is a closed
connection: so a rank whose step failed shuts down the TCP connections its process groups opened, exactly
as its death would, and every peer blocked on it fails at once and does the same. The failure spreads
through the grid in milliseconds and no survivor has to be restarted for being blocked.

Only connections are shut down (never gloo's listening socket: its event loop aborts the process on that),
with ``shutdown`` on a duplicate descriptor, never ``close``, so gloo's own descriptors stay valid until
it destroys the group itself. Linux only (``/proc/self/fd``); elsewhere nothing is recorded.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_FDS = "/proc/self/fd"


def _sockets() -> dict[int, str]:
    """This process's socket descriptors -> their inode (``socket:[123]``); empty where /proc is missing."""
    if not os.path.isdir(_FDS):
        return {}
    out = {}
    for name in os.listdir(_FDS):
        try:
            link = os.readlink(f"{_FDS}/{name}")
        except OSError:  # closed while listing
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


class GroupSockets:
    """The sockets opened while a rank's process groups were built, to shut down when it leaves them."""

    def __init__(self) -> None:
        self.opened: dict[int, str] = {}

    def record(self, build: Callable[[], T]) -> T:
        """Run ``build`` (what creates the process groups) and remember the sockets it opened."""
        before = _sockets()
        result = build()
        self.opened = {fd: link for fd, link in _sockets().items() if before.get(fd) != link}
        return result

    def leave(self) -> int:
        """Shut down the recorded TCP connections (peers then see this rank as gone); returns how many."""
        current, shut = _sockets(), 0
        for fd, link in self.opened.items():
            if current.get(fd) != link:  # closed since, or its number reused by another socket
                continue
            try:
                with socket.socket(fileno=os.dup(fd)) as sock:
                    if sock.family not in (socket.AF_INET, socket.AF_INET6):
                        continue
                    sock.getpeername()  # raises for a listening socket
                    sock.shutdown(socket.SHUT_RDWR)
                    shut += 1
            except OSError:
                continue
        self.opened = {}
        return shut
