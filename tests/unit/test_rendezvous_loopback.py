"""A one-host job listens on loopback only: the rendezvous store and gloo's own sockets (closed by default).

Two real gloo ranks are spawned; each lists the TCP sockets its process is listening on after the groups are
built (the store, gloo's pair listeners, the mesh's sub-groups) and every one must be bound to 127.0.0.1.
"""

from __future__ import annotations

import os
import socket

import pytest

from tests.support.parity_harness import rank_ports, spawn_ranks
from workers.contract.grid import Grid

LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


def listening_addresses() -> list[str]:
    """The local addresses this process listens on, from /proc (IPv4 as dotted quads, IPv6 as hex)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            rows = [line.split() for line in f.readlines()[1:]]
        out += [_address(row[1]) for row in rows if row[3] == LISTEN and row[9] in inodes]
    return out


def _address(hex_addr: str) -> str:
    host = hex_addr.split(":")[0]
    if len(host) == 8:  # IPv4, little-endian
        return socket.inet_ntoa(bytes.fromhex(host)[::-1])
    return host


def _rank(rank: int, ports, world: int, how: str, results) -> None:
    import torch

    from workers.parallel.process_group import init_mesh, join_on_loopback

    os.environ.pop("GLOO_SOCKET_IFNAME", None)
    port, listener = ports.join(rank, 0)
    if how == "job":
        init_mesh(rank, world, "127.0.0.1", port, Grid(dp=world), torch.device("cpu"), timeout_s=60,
                  listener=listener)
    else:  # the benchmarks' and the Ray-free tests' own groups
        join_on_loopback(rank, world, port, timeout_s=60, listener=listener)
    results.put((rank, listening_addresses()))


def test_listening_addresses_sees_an_all_interfaces_socket():
    """The check below could fail: a socket bound to every interface is reported as 0.0.0.0."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        assert "0.0.0.0" in listening_addresses()


@pytest.mark.parametrize("how", ["job", "join_on_loopback"])
def test_a_one_host_job_listens_on_loopback_only(how):
    by_rank = spawn_ranks(_rank, (rank_ports(1), 2, how), world_size=2, timeout_s=120)
    assert by_rank[0], "rank 0 serves the store: it must be listening somewhere"
    for rank, addresses in by_rank.items():
        assert addresses and all(a.startswith("127.") for a in addresses), (rank, addresses)
