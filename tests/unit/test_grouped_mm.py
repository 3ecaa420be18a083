"""``Experts._grouped_mm`` (three ``torch._grouped_mm`` calls over the runs' end offsets) computes what the per-expert
loop computes, forward and backward, SwiGLU and GELU experts, with empty runs and keyed expert dropout. Run here on
CPU, where torch 2.13's ``_grouped_mm`` also works (fp32 and bf16); in training the path is taken only on CUDA in
bf16 (``_grouped_mm_applies``), which this machine has no GPU to run."""

from __future__ import annotations

import pytest
import torch

from workers.model.moe import Experts, _grouped_mm_applies

COUNTS = torch.tensor([3, 0, 5, 1])  # expert 1 gets no row: an empty group must be an empty run


def _experts(swiglu: bool, dropout: float = 0.0) -> Experts:
    torch.manual_seed(0)
    experts = Experts(4, 16, 24, swiglu, dropout)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.2)
    return experts


def _both(experts: Experts, x: torch.Tensor, keys: torch.Tensor | None = None):
    """(grouped, loop) outputs and the gradients each gives the input and the weights."""
    results = []
    for path in ("grouped", "loop"):
        xi = x.detach().clone().requires_grad_(True)
        experts.zero_grad()
        mixed = experts.expert_keys(keys, COUNTS)
        out = experts._grouped_mm(xi, COUNTS, mixed) if path == "grouped" else experts.grouped(xi, COUNTS, keys)
        out.float().pow(2).sum().backward()
        results.append((out.detach(), xi.grad, {n: p.grad.clone() for n, p in experts.named_parameters()}))
    return results


@pytest.mark.parametrize("swiglu", [True, False])
def test_grouped_gemm_is_the_per_expert_loop_in_fp32(swiglu):
    experts = _experts(swiglu)
    x = torch.randn(int(COUNTS.sum()), 16, generator=torch.Generator().manual_seed(1))
    assert not _grouped_mm_applies(x, experts)  # so grouped() below is the loop
    (out, dx, dw), (ref, ref_dx, ref_dw) = _both(experts, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-6)
    for name in ref_dw:
        torch.testing.assert_close(dw[name], ref_dw[name], rtol=1e-5, atol=1e-6)


def test_grouped_gemm_is_the_loop_in_bf16_as_training_runs_it():
    experts = _experts(True).to(torch.bfloat16)
    x = torch.randn(int(COUNTS.sum()), 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    (out, dx, _), (ref, ref_dx, _) = _both(experts, x)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dx, ref_dx, rtol=2e-2, atol=2e-2)


def test_grouped_gemm_drops_the_units_the_loop_drops():
    """Keyed expert dropout: the mask is a hash of the row's key and expert, the same on both paths."""
    experts = _experts(True, dropout=0.3).train()
    x = torch.randn(int(COUNTS.sum()), 16, generator=torch.Generator().manual_seed(1))
    keys = torch.arange(100, 100 + len(x))
    (out, dx, _), (ref, ref_dx, _) = _both(experts, x, keys)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-6)
