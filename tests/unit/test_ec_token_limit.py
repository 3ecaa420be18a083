"""Expert choice capped per token (``model.moe.max_experts_per_token``; seed 001 lines 203–207): the
entropy-regularised assignment from Dykstra's algorithm (workers/model/ec_dykstra.py) equals the optimum of

    max_A <S^T, A> + λ H(A)  s.t.  rows sum to k, columns sum to at most b, 0 <= A <= 1,

found here in float64 by a general constrained solver (SciPy's SLSQP) on small groups; the router's discrete
picks respect both limits, match the picks of the float64 optimum, and differ from uncapped expert choice where
a token is every expert's favourite; the spec refuses a limit that cannot apply."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from orchestrator import JobSpec
from orchestrator.errors import SpecError
from workers.model.config import MoEConfig
from workers.model.ec_dykstra import capped_choice, dykstra_assignment
from workers.model.moe import ExpertChoiceRouter, SequenceNoise


def _scores(n: int, e: int, seed: int) -> torch.Tensor:
    """Scores [1, n, e] in [0, 1], float64, with token 0 every expert's best by a margin (so its limit binds;
    a router's softmax over experts cannot make one token everyone's favourite, raw scores can)."""
    scores = torch.rand(1, n, e, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.5
    scores[0, 0] += 0.5
    return scores


def _optimum(scores: torch.Tensor, k: int, b: int, entropy: float) -> np.ndarray:
    """The regularised optimum A [e, n] by SLSQP in float64: an independent solver of the seed's problem."""
    s = scores[0].T.numpy()  # [e, n]
    e, n = s.shape

    def objective(flat):
        a = np.clip(flat, 1e-300, None)
        return -(s.ravel() @ flat) + entropy * float((a * np.log(a)).sum())

    def gradient(flat):
        return -s.ravel() + entropy * (np.log(np.clip(flat, 1e-300, None)) + 1)

    rows = {"type": "eq", "fun": lambda f: f.reshape(e, n).sum(1) - k,
            "jac": lambda f: np.kron(np.eye(e), np.ones((1, n)))}
    columns = {"type": "ineq", "fun": lambda f: b - f.reshape(e, n).sum(0),
               "jac": lambda f: -np.kron(np.ones((1, e)), np.eye(n))}
    start = np.full(e * n, k / n)
    out = minimize(objective, start, jac=gradient, bounds=[(1e-12, 1.0)] * (e * n), constraints=[rows, columns],
                   method="SLSQP", options={"ftol": 1e-15, "maxiter": 2000})
    assert out.success, out.message
    return out.x.reshape(e, n)


CASES = [  # (tokens n, experts e, k, b, λ, seed), each feasible: e·k <= n·b
    (6, 3, 3, 2, 0.05, 0), (8, 4, 3, 2, 0.1, 1), (5, 4, 1, 1, 0.05, 2), (10, 3, 6, 2, 0.2, 3),
]


@pytest.mark.parametrize("n, e, k, b, entropy, seed", CASES)
def test_dykstra_reaches_the_float64_optimum(n, e, k, b, entropy, seed):
    scores = _scores(n, e, seed)
    got = dykstra_assignment(scores, k, b, entropy, iterations=3000)[0].numpy()
    want = _optimum(scores, k, b, entropy)
    assert np.abs(got - want).max() < 1e-5, np.abs(got - want).max()
    assert np.allclose(got.sum(1), k, atol=1e-9) and (got.sum(0) <= b + 1e-9).all() and (got <= 1 + 1e-12).all()
    assert np.isclose(got[:, 0].sum(), b, atol=1e-6)  # the favourite token is at its limit: the cap binds


def _router(experts: int, b: int | None, capacity: float):
    """An expert-choice router at the job file's defaults (λ 0.05, 200 Dykstra cycles), seeded weights."""
    cfg = MoEConfig(experts=experts, router="expert_choice", capacity_factor=capacity, max_experts_per_token=b)
    router = ExpertChoiceRouter(cfg, 8)
    torch.nn.init.normal_(router.weight, 0.0, 1.0, generator=torch.Generator().manual_seed(5))
    return router


def _per(routing, n_tokens: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments per token and per expert."""
    return (torch.bincount(routing.token, minlength=n_tokens), torch.bincount(routing.expert, minlength=experts))


def test_the_router_holds_both_limits_and_picks_as_the_float64_optimum():
    torch.manual_seed(0)
    x = torch.randn(2, 12, 8)  # 2 groups of 12 tokens
    b, experts, capacity = 2, 4, 2.0
    router = _router(experts, b, capacity)
    routing = router(x, SequenceNoise.__new__(SequenceNoise))
    per_token, per_expert = _per(routing, 24, experts)
    k = router.tokens_per_expert(12)
    assert per_token.max() <= b and (per_expert <= 2 * k).all()
    scores = router.logits(x).softmax(-1).detach()
    assert torch.allclose(routing.gate, scores.reshape(-1, experts)[routing.token, routing.expert])
    reference = torch.stack([torch.from_numpy(_optimum(scores[i:i + 1].double(), k, b, 0.05)) for i in range(2)])
    want = capped_choice(reference, k, b).nonzero(as_tuple=True)
    assert sorted(zip(routing.token.tolist(), routing.expert.tolist())) == sorted(
        zip((want[2] + 12 * want[0]).tolist(), want[1].tolist()))
    uncapped = _router(experts, None, capacity)(x, None)
    assert _per(uncapped, 24, experts)[0].max() > b  # without the cap a token takes more than b experts


def test_the_router_backpropagates_into_its_gates():
    router = _router(4, 2, 2.0)
    x = torch.randn(1, 8, 8)
    router(x, None).gate.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def _spec(tmp_path, moe: dict) -> JobSpec:
    return JobSpec.from_dict({"data": {"path": str(tmp_path)}, "model": {"moe": moe}})


@pytest.mark.parametrize("moe, field, fix", [
    ({"router": "topk", "max_experts_per_token": 2}, "max_experts_per_token", "router: expert_choice"),
    ({"router": "expert_choice", "experts": 4, "max_experts_per_token": 4}, "max_experts_per_token", "below 4"),
    ({"router": "expert_choice", "capacity_factor": 3, "max_experts_per_token": 2}, "max_experts_per_token",
     "at least 3"),
    ({"router": "expert_choice", "ec_entropy": 0.2}, "ec_entropy", "max_experts_per_token"),
])
def test_spec_refuses_a_limit_that_cannot_apply(moe, field, fix, tmp_path):
    with pytest.raises(SpecError, match=rf"model\.moe\.{field}.*{fix}"):
        _spec(tmp_path, moe)
