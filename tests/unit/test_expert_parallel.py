"""``ExpertParallelDispatcher`` over 4 spawned gloo ranks equals each rank's tokens run through all experts locally.

Forward and gradients (tokens, gates; expert weights as one rank's share: the group's sum over ep), ep=4 and
ep=2 (two groups of two) in one spawn, with uneven counts, top-2 assignments with some dropped, a token with no
assignment and an expert that receives no token anywhere. The reference is a plain per-assignment loop written
here, over the whole expert stack.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests.support.parity_harness import rank_ports, spawn_ranks
from workers.parallel.expert_parallel import ExpertParallelDispatcher, expert_major
from workers.parallel.process_group import join_on_loopback

WORLD, E, D, H, T = 4, 8, 6, 5, 7
EMPTY = 5  # no rank routes a token to this expert


class StackedExperts(nn.Module):
    """The ``Experts`` contract (stacked weights, ``grouped``) for the local slice ``[first, first + num_local)``."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, first: int, num_experts: int):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(w1.clone()), nn.Parameter(w2.clone())
        self.first, self.num_local, self.num_experts = first, w1.shape[0], num_experts

    def grouped(self, x: torch.Tensor, counts: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        assert keys is None  # no expert dropout here
        runs = x.split(counts.tolist())
        return torch.cat([torch.relu(r @ self.w1[j]) @ self.w2[j] for j, r in enumerate(runs)])


class Routing:
    def __init__(self, token, expert, gate):
        self.token, self.expert, self.gate, self.losses, self.stats = token, expert, gate, {}, {}
        self.token_keys = None  # no expert dropout here


def _routing(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 of a random score per token on this rank, then some assignments dropped (rank-dependent counts)."""
    g = torch.Generator().manual_seed(100 + rank)
    scores = torch.rand(T, E, generator=g)
    scores[:, EMPTY] = -1.0
    expert = scores.topk(2, dim=1).indices
    token = torch.arange(T).repeat_interleave(2)
    keep = torch.rand(2 * T, generator=g) > 0.3
    keep[:2] = False  # token 0 has no assignment: carried by the residual alone
    return token[keep], expert.flatten()[keep]


def _reference(x, token, expert, gate, w1, w2) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t, e, g in zip(token.tolist(), expert.tolist(), gate):
        out[t] = out[t] + g * (torch.relu(x[t] @ w1[e]) @ w2[e])
    return out


def _check(rank: int, group, group_rank: int, ep: int) -> None:
    torch.manual_seed(0)
    w1, w2 = torch.randn(E, D, H), torch.randn(E, H, D)
    g = torch.Generator().manual_seed(rank)
    x, weights = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    token, expert = _routing(rank)
    gate = torch.rand(len(token), generator=g)
    local = E // ep
    first = group_rank * local

    xr, gr, w1r, w2r = (t.clone().requires_grad_() for t in (x, gate, w1, w2))
    ref = _reference(xr, token, expert, gr, w1r, w2r)
    (ref * weights).sum().backward()

    experts = StackedExperts(w1[first:first + local], w2[first:first + local], first, E)
    xe, ge = x.clone().requires_grad_(), gate.clone().requires_grad_()
    out = ExpertParallelDispatcher(group)(xe, Routing(token, expert, ge), experts)
    (out * weights).sum().backward()

    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xe.grad, xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ge.grad, gr.grad, rtol=1e-5, atol=1e-6)
    for mine, full in ((experts.w1, w1r), (experts.w2, w2r)):
        share = full.grad / ep  # an expert's gradient: every group rank's tokens, as one rank's share (1 / ep)
        dist.all_reduce(share, group=group)
        torch.testing.assert_close(mine.grad, share[first:first + local], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(experts.w1.grad[EMPTY - first]) == 0 if first <= EMPTY < first + local else True


def _rank_main(rank: int, ports, results) -> None:
    torch.set_num_threads(1)
    port, listener = ports.join(rank, 0)
    join_on_loopback(rank, WORLD, port, listener=listener)
    _check(rank, dist.group.WORLD, rank, WORLD)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    _check(rank, pairs[rank // 2], rank % 2, 2)
    dist.destroy_process_group()
    results.put((rank, "checked"))


def test_dispatch_over_ep4_and_ep2_matches_local_experts_forward_and_backward():
    assert spawn_ranks(_rank_main, (rank_ports(1),), WORLD, timeout_s=120) == dict.fromkeys(range(WORLD), "checked")


def test_expert_major_reorders_peer_major_chunks():
    received = torch.tensor([[2, 0, 1], [1, 3, 0]])  # peer 0 sends 2, 0, 1 rows to experts 0..2; peer 1 sends 1, 3, 0
    # buffer rows: p0e0 p0e0 p0e2 p1e0 p1e1 p1e1 p1e1 -> expert 0 (p0, p0, p1), expert 1 (p1 x3), expert 2 (p0)
    assert expert_major(received).tolist() == [0, 1, 3, 4, 5, 6, 2]
