"""Loopback ports for the servers tests start: free ones for Ray clusters of their own, and the ports spawned gloo
groups bind as they form (``GroupPorts``)."""

from __future__ import annotations

import random
import socket
import time

# Below Linux's ephemeral range (32768-60999) and above Ray's worker ports (10002-19999): the kernel never hands
# these to an outgoing connection or to a socket bound to port 0, so a port picked here for a server that starts
# seconds or minutes later (run_layouts picks every job's port up front; a Ray node starts its dashboard agent long
# after the suite's processes took ephemeral ports) is not taken meanwhile (EADDRINUSE at the bind).
PORTS = range(20000, 32768)


def free_port() -> int:
    """A loopback port nobody is bound to right now, outside the ephemeral range (see ``PORTS``)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {PORTS.start}-{PORTS.stop - 1} after 200 tries")


def free_ports(n: int) -> list[int]:
    """``n`` different ports, each free right now (``free_port``)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


class GroupPorts:
    """The rendezvous ports of the gloo groups spawned ranks form, one group after another: rank 0 binds each
    group's port as the group forms (port 0: the kernel hands out one nobody holds) and publishes it here; its
    peers read it.

    Why not ports picked up front (``free_port``): a port free when picked can be taken before its group forms.
    CI saw it (EADDRINUSE at rank 0's bind) in a spawn of ten jobs, the last formed minutes after its port was
    picked. Binding as the group forms leaves no such window, as the controller's ``rendezvous_address`` does.
    Create it before the ranks start (from their multiprocessing context), pass it to them, and hold it until they
    are done: a spawned rank unpickles it as it starts, after ``Process.start`` has dropped its own reference.
    """

    def __init__(self, groups: int, ctx):
        self._ports = ctx.Array("i", groups)

    def join(self, rank: int, group: int, timeout_s: float = 300.0) -> tuple[int, socket.socket | None]:
        """Group ``group``'s port, and on rank 0 the socket listening on it (for the store: ``listener=``). A peer
        waits for rank 0 as long as a store client would (``timeout_s``: the collective timeout's default)."""
        from workers.parallel.process_group import listen_on

        if rank == 0:
            listener = listen_on("127.0.0.1")
            self._ports[group] = listener.getsockname()[1]
            return self._ports[group], listener
        deadline = time.monotonic() + timeout_s
        while (port := self._ports[group]) == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 published no port for group {group} in {timeout_s}s")
            time.sleep(0.01)
        return port, None
