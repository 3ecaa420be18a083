"""A rank that leaves its gloo group (``GroupSockets.leave``) makes a peer blocked on it fail at once, not at the
collective timeout, and both can form a new group afterwards (the leaver's process is not aborted by gloo)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.ports import GroupPorts
from workers.group_sockets import GroupSockets
from workers.parallel.process_group import join_on_loopback

TIMEOUT_S = 60  # the blocked peer must fail long before this
# the leaving rank keeps its group until the peer is unblocked, or at most this long: only leaving can unblock the
# peer sooner, however slow the machine (a fixed hold of 3 s was a window a loaded machine could cross)
HELD_S = 30.0


def _join(rank: int, ports: GroupPorts, group: int) -> None:
    port, listener = ports.join(rank, group)
    join_on_loopback(rank, 2, port, TIMEOUT_S, listener)


def _rank_main(rank: int, ports: GroupPorts, results, unblocked) -> None:
    sockets = GroupSockets()
    sockets.record(lambda: _join(rank, ports, 0))
    if rank == 0:  # blocked on a peer that never sends: only the peer leaving its group can end this early
        t0 = time.monotonic()
        try:
            dist.recv(torch.zeros(2), src=1)
            results.put(("blocked", "received"))
        except RuntimeError as exc:
            results.put(("blocked", (time.monotonic() - t0, str(exc).splitlines()[0])))
        unblocked.set()
    else:  # leaves, but keeps the group alive (as the trainer's objects do) for longer than the peer may wait
        time.sleep(0.5)
        results.put(("shut", sockets.leave()))
        unblocked.wait(HELD_S)
    dist.destroy_process_group()
    _join(rank, ports, 1)
    x = torch.full((2,), float(rank + 1))
    dist.all_reduce(x)
    results.put((f"reformed{rank}", x.tolist()))
    dist.destroy_process_group()


def test_leaving_unblocks_a_peer_and_the_group_forms_again():
    ctx = mp.get_context("fork")
    results, unblocked = ctx.SimpleQueue(), ctx.Event()
    procs = mp.start_processes(_rank_main, args=(GroupPorts(2, ctx), results, unblocked), nprocs=2,
                               join=False, start_method="fork")
    while not procs.join(timeout=TIMEOUT_S):
        pass
    got = dict(results.get() for _ in range(4))
    assert got["shut"] >= 1  # at least its connection to the peer
    waited, message = got["blocked"]
    assert waited < HELD_S, f"the peer waited {waited:.1f} s: leaving did not unblock it"
    assert "closed" in message.lower() or "reset" in message.lower(), message
    assert got["reformed0"] == got["reformed1"] == [3.0, 3.0]
