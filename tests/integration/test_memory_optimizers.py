"""Memory-efficient optimizers: SM3 (ours) keeps the SM3 bounds, trains, and steps shards exactly;
Adafactor (PyTorch's) trains."""

from __future__ import annotations

import pytest
import torch

from tests.support.jobs import tiny_spec
from tests.support.models import SMALL_MODEL, random_batch
from tests.support.parity_harness import run_spec
from tests.support.reference import reference_run
from workers.contract.sections import OptimSection
from workers.model.gpt import GPT, lm_loss
from workers.model.registry import model_config
from workers.optim.build import build_optimizer
from workers.optim.sm3 import SM3


def test_sm3_on_vectors_is_adagrad():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(50))
    b = torch.nn.Parameter(a.detach().clone())
    ours, theirs = SM3([a], lr=0.1, eps=1e-10), torch.optim.Adagrad([b], lr=0.1, eps=1e-10)
    for step in range(5):
        a.grad = b.grad = torch.randn(50, generator=torch.Generator().manual_seed(step))
        ours.step()
        theirs.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_sm3_cover_bounds_adagrad_and_costs_a_vector_per_dimension():
    """SM3's nu upper-bounds Adagrad's per-entry sum of squares (paper, Proposition 1) with d1+d2 floats."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(24, 40))
    opt = SM3([p], lr=0.01)
    adagrad_sum = torch.zeros_like(p)
    for step in range(6):
        p.grad = torch.randn(24, 40, generator=torch.Generator().manual_seed(step)) * (step + 1)
        adagrad_sum += p.grad ** 2
        opt.step()
        state = opt.state[p]
        nu = torch.minimum(state["acc_0"], state["acc_1"])
        assert bool((nu >= adagrad_sum * (1 - 1e-6)).all())
    assert state["acc_0"].shape == (24, 1) and state["acc_1"].shape == (1, 40)


@pytest.mark.parametrize("name, lr", [("sm3", 0.05), ("adafactor", 0.3)])
def test_trains_the_tiny_gpt(name, lr):
    torch.manual_seed(0)
    model = GPT(model_config(SMALL_MODEL))
    opt = build_optimizer(model.parameters(), OptimSection(name=name, lr=lr, momentum=0.9, betas=(0.9, 0.95)))
    assert type(opt) is (SM3 if name == "sm3" else torch.optim.Adafactor)
    losses = []
    for step in range(12):
        x, y = random_batch(step % 2)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0], losses


def test_sm3_steps_fsdp_and_tensor_parallel_shards_like_one_process(token_data, tmp_path):
    """ZeRO-3 over tp=2 (row- and column-sharded matrices, FSDP2's strided shards on top): cover maxima
    all-reduced over the sharding mesh dims give the single-process SM3 step."""
    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 2, "tp": 2, "zero": 3, "device": "cpu"},
                     optim={"name": "sm3", "lr": 0.05, "momentum": 0.9}, train={"steps": 5})
    losses, grad_norms = reference_run(spec, 5)
    result = run_spec(spec)  # the optimizer lives in the ranks
    assert result.losses == pytest.approx(losses, rel=1e-4)
    assert result.grad_norms == pytest.approx(grad_norms, rel=1e-4)
