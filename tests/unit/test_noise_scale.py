"""The gradient noise scale (McCandlish et al. 2018; seed 002 lines 179-184): B_simple = tr(Σ)/|G|² from squared
gradient norms at a small and a large batch, checked against the formula and against per-example gradients."""

from __future__ import annotations

import math

import pytest
import torch

from orchestrator.cli import main
from orchestrator.planning.noise_scale import batch_norms, estimate, measure
from tests.support.jobs import tiny_spec


def test_the_estimates_invert_the_expected_norms_exactly():
    """E|G_B|² = |G|² + tr(Σ)/B: fed those expectations, the estimator returns |G|² and tr(Σ) themselves."""
    grad_sq, trace = 0.7, 42.0
    expected = {b: grad_sq + trace / b for b in (4, 32)}
    got = estimate(4, 32, [expected[4]], [expected[32]])
    assert got.grad_sq == pytest.approx(grad_sq, rel=1e-12) and got.trace == pytest.approx(trace, rel=1e-12)
    assert got.b_simple == pytest.approx(60.0, rel=1e-12)


def test_a_small_batch_not_below_the_large_one_is_refused():
    with pytest.raises(ValueError, match="small batch"):
        estimate(8, 8, [1.0], [1.0])


def test_measured_norms_give_the_per_example_gradients_noise_scale():
    """Least squares on 4,096 examples: tr(Σ) and |G|² computed from every per-example gradient; the estimate
    from batches of 8 and 64 (64 large batches, each cut into 8 small ones) lands within 10% of their ratio."""
    gen = torch.Generator().manual_seed(0)
    n, dim = 4096, 16
    x = torch.randn(n, dim, generator=gen, dtype=torch.float64)
    y = x @ torch.ones(dim, dtype=torch.float64) + 0.5 + torch.randn(n, generator=gen, dtype=torch.float64)
    w = torch.zeros(dim, dtype=torch.float64, requires_grad=True)
    per_example = 2 * (x @ w.detach() - y)[:, None] * x  # gradient of (w·x - y)² per example
    true_g = per_example.mean(0)
    true_trace = per_example.var(0, unbiased=True).sum()
    truth = float(true_trace / true_g.square().sum())

    def gradient(piece):
        xs, ys = piece
        return torch.autograd.grad((xs @ w - ys).square().mean(), [w])

    small, big = [], []
    for batch in range(64):
        rows = slice(batch * 64, (batch + 1) * 64)
        s, b = batch_norms(gradient, list(zip(x[rows].chunk(8), y[rows].chunk(8), strict=True)))
        small.append(s)
        big.append(b)
    assert estimate(8, 64, small, big).b_simple == pytest.approx(truth, rel=0.1)


def test_measure_on_the_tiny_job_splits_its_batch_by_dp(token_data, tmp_path):
    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 2, "device": "cpu"})
    got = measure(spec, batches=2)
    assert (got.b_small, got.b_big) == (4, 8)
    assert got.trace > 0 and math.isfinite(got.b_simple)
    assert "train.global_batch_size 8 is" in got.advice(8)


def test_plan_reports_it(token_data, tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(f"data: {{path: {token_data}}}\nmodel: {{d_model: 32, n_layers: 2, n_heads: 4, seq_len: 32}}\n"
                   "train: {global_batch_size: 8, microbatches: 2}\nparallel: {device: cpu}\n")
    assert main(["plan", str(job), "--noise-scale", "2"]) == 0
    assert "advice: gradient noise scale B_simple = tr(Σ)/|G|² = " in capsys.readouterr().out
