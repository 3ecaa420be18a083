"""Seed 004's parameter-server vs ring all-reduce table (lines 126-144), reproduced from bytes measured on real
transfers: N workers average Φ bytes of gradients once through a parameter server (every worker sends its
gradient to the server and receives the average) and once through a ring (reduce-scatter, then all-gather, chunk
by chunk to the next rank), over gloo send/recv on loopback; each rank counts what it sends and receives, both
exchanges produce the true average, and the counts, divided by a bandwidth B, are the seed's table
(``comm_model.ps_vs_ring``): the server NΦ/B, a worker Φ/B, a ring card 2(N-1)/N·Φ/B."""

from __future__ import annotations

import pytest
import torch

from orchestrator.planning.comm_model import ps_vs_ring
from tests.support.parity_harness import rank_ports, spawn_ranks

N, ELEMENTS = 4, 1200  # 4 workers, Φ = 4,800 bytes of float32 gradients
BANDWIDTH = 1e9


def _gradient(rank: int) -> torch.Tensor:
    return torch.arange(ELEMENTS, dtype=torch.float32) * (rank + 1)


class _Counted:
    """send/recv that count bytes per direction."""

    def __init__(self):
        self.sent = self.got = 0

    def send(self, t: torch.Tensor, to: int) -> None:
        import torch.distributed as dist

        dist.send(t.contiguous(), to)
        self.sent += t.numel() * t.element_size()

    def recv(self, like: torch.Tensor, source: int) -> torch.Tensor:
        import torch.distributed as dist

        out = torch.empty_like(like)
        dist.recv(out, source)
        self.got += out.numel() * out.element_size()
        return out


def _parameter_server(rank: int, link: _Counted) -> torch.Tensor | None:
    """Rank N is the server: it receives every worker's gradient, averages, and sends the average back."""
    if rank == N:
        mean = sum(link.recv(_gradient(0), w) for w in range(N)) / N
        for w in range(N):
            link.send(mean, w)
        return None
    link.send(_gradient(rank), N)
    return link.recv(_gradient(rank), N)


def _ring(rank: int, link: _Counted) -> torch.Tensor:
    """Reduce-scatter then all-gather around the ring, one chunk (Φ/N) to the next rank per round."""
    chunks = list(_gradient(rank).chunk(N))
    right, left = (rank + 1) % N, (rank - 1) % N
    for phase in ("reduce-scatter", "all-gather"):
        for r in range(N - 1):
            out = (rank - r + (phase == "all-gather")) % N
            into = (rank - r - 1 + (phase == "all-gather")) % N
            # even ranks send first, odd receive first: blocking send/recv around a ring without deadlock
            if rank % 2 == 0:
                link.send(chunks[out], right)
                got = link.recv(chunks[into], left)
            else:
                got = link.recv(chunks[into], left)
                link.send(chunks[out], right)
            chunks[into] = chunks[into] + got if phase == "reduce-scatter" else got
    return torch.cat(chunks) / N


def _rank_main(rank: int, ports, world: int, exchange, results) -> None:
    import torch.distributed as dist

    from workers.parallel.process_group import join_on_loopback

    port, listener = ports.join(rank, 0)
    join_on_loopback(rank, world, port, listener=listener)
    link = _Counted()
    mean = exchange(rank, link)
    dist.destroy_process_group()
    results.put((rank, (link.got, link.sent, None if mean is None else mean.tolist())))  # plain data: no fds


def _measured(exchange, world: int) -> dict:
    return spawn_ranks(_rank_main, (rank_ports(1), world, exchange), world, 120.0)


def test_measured_bytes_reproduce_the_seed_table():
    phi = ELEMENTS * 4
    table = ps_vs_ring(phi, N, BANDWIDTH)
    truth = sum(_gradient(r) for r in range(N)) / N

    ps = _measured(_parameter_server, N + 1)
    got, sent, _ = ps[N]
    assert (got, sent, max(got, sent) / BANDWIDTH) == table["ps server"] == (N * phi, N * phi, N * phi / BANDWIDTH)
    for w in range(N):
        got, sent, mean = ps[w]
        assert (got, sent, max(got, sent) / BANDWIDTH) == table["ps worker"]
        torch.testing.assert_close(torch.tensor(mean), truth)

    ring = _measured(_ring, N)
    for r in range(N):
        got, sent, mean = ring[r]
        assert (got, sent, max(got, sent) / BANDWIDTH) == table["ring all-reduce"]
        assert got == 2 * table["ring reduce-scatter"][0] == 2 * (N - 1) * phi / N
        torch.testing.assert_close(torch.tensor(mean), truth)
    # the seed's point: the server's time grows with N, a ring card's stays about 2Φ/B
    assert table["ps server"][2] / table["ring all-reduce"][2] == pytest.approx(N * N / (2 * (N - 1)))


@pytest.mark.parametrize("n", [2, 8, 64, 1024])
def test_the_ring_stays_near_two_phi_while_the_server_grows(n):
    table = ps_vs_ring(1.0, n, 1.0)
    assert table["ps server"][2] == n and table["ps worker"][2] == 1.0
    assert 1.0 <= table["ring all-reduce"][2] < 2.0 and table["ring all-reduce"][2] == pytest.approx(2, rel=2 / n)
