"""Free loopback ports for the servers tests start (gloo stores, Ray clusters of their own)."""

from __future__ import annotations

import random
import socket

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
