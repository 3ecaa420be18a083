"""Expert choice with a per-token limit (Zhou et al. 2022, §3.3; seed 001 lines 203–207), by Dykstra's algorithm.

Plain expert choice lets each expert take its top-k tokens, so one token can land in every expert. The capped
form solves, per routing group, with S the [n, e] token-to-expert scores,

    max_A  <S^T, A> + λ H(A)   s.t.  every expert's row sums to k,  every token's column sums to at most b,
                                     0 <= A <= 1,

with H(A) = -Σ A log A. Because every row sums to k, Σ A is the constant e·k. The problem is therefore the
KL (Bregman) projection of exp(S^T / λ) onto the intersection of the three sets:

* rows = k: an affine set, projected by scaling each row (Sinkhorn's step);
* columns <= b: each column whose sum exceeds b is scaled down to b;
* A <= 1: entries above 1 are clipped.

KL projections onto an intersection are what Dykstra's algorithm (Bregman form, Bauschke & Lewis 2000) computes by
cycling through the sets. The two inequality sets each carry a correction term; the affine one needs none. Here
it runs in the log domain (corrections are additive there), so no entry under- or overflows for a small λ.
``iterations`` cycles give the fractional A. The routing then takes each expert's top k tokens by A, and keeps
each token's b best of those picks, so the limit holds exactly even before A has fully converged.
"""

from __future__ import annotations

import math

import torch


def dykstra_assignment(scores: torch.Tensor, k: int, b: int, entropy: float, iterations: int) -> torch.Tensor:
    """The fractional assignment A [G, e, n] for scores [G, n, e] (module doc): rows sum to ``k``, columns at
    most ``b``, entries in [0, 1]. Computed in the scores' dtype (the router's float32; the test's float64)."""
    log_a = scores.transpose(1, 2) / entropy  # [G, e, n]
    log_k, log_b = math.log(k), math.log(b)
    columns = torch.zeros_like(log_a)  # Dykstra's corrections for the two inequality sets
    ceiling = torch.zeros_like(log_a)
    for _ in range(iterations):
        log_a = log_a - (torch.logsumexp(log_a, -1, keepdim=True) - log_k)
        shifted = log_a + columns
        log_a = shifted - (torch.logsumexp(shifted, -2, keepdim=True) - log_b).clamp(min=0)
        columns = shifted - log_a
        shifted = log_a + ceiling
        log_a = shifted.clamp(max=0)
        ceiling = shifted - log_a
    return log_a.exp()


def capped_choice(assignment: torch.Tensor, k: int, b: int) -> torch.Tensor:
    """The discrete picks [G, e, n] (bool) from A [G, e, n]: each expert's top ``k`` tokens, then each token's
    ``b`` largest of its picks (ties broken by expert index, as ``topk`` does)."""
    picked = torch.zeros_like(assignment, dtype=torch.bool)
    picked.scatter_(-1, assignment.topk(k, -1).indices, True)
    masked = assignment.masked_fill(~picked, -1.0)
    keep = min(b, assignment.shape[1])
    best = torch.zeros_like(picked)
    best.scatter_(1, masked.topk(keep, 1).indices, True)
    return picked & best
