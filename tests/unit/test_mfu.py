"""Model FLOPs per token, the numerator of MFU (the step records, the exporter, benchmarks/gpu.py)."""

from __future__ import annotations

import pytest

from orchestrator import JobSpec
from orchestrator.planning.estimate import FFN_MATRICES
from orchestrator.planning.flops import model_flops_per_token


def spec(**model) -> JobSpec:
    return JobSpec.from_dict({"data": {"path": "d"}, "model": {"d_model": 64, "n_layers": 4, **model}})


@pytest.mark.parametrize("moe, experts_per_token", [
    ({"experts": 4, "top_k": 1}, 1),
    ({"experts": 4, "top_k": 2}, 2),
    ({"experts": 8, "router": "expert_choice", "capacity_factor": 2.0}, 2.0),
])
def test_an_moe_token_costs_the_experts_it_passes_through(moe, experts_per_token):
    """Each expert as wide as the dense feed-forward: an MoE token routed to k experts costs the dense model's
    FLOPs plus (k - 1) feed-forwards and the router per layer; the routed experts were left out altogether."""
    dense, sparse = spec(), spec(moe=moe)
    m = dense.model
    ffn = FFN_MATRICES[m.arch] * m.d_model * m.ffn_dim  # one expert's parameters
    router = m.d_model * moe["experts"]
    expected = model_flops_per_token(dense) + 6 * m.n_layers * ((experts_per_token - 1) * ffn + router)
    assert model_flops_per_token(sparse) == pytest.approx(expected)
