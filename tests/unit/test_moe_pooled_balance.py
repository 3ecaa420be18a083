"""``model.moe.balance_loss: pooled`` is ``transformers``' balance loss (``load_balancing_loss_func``: choice
fractions and mean probabilities averaged over all MoE layers, then one product), so a Mixtral's or Qwen3-MoE's
``router_aux_loss_coef`` as ``aux_loss_weight`` weighs what it weighs in transformers: value and router gradients
equal to transformers' over one forward (``group: microbatch``); raymesh's per-layer sum is another quantity."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from orchestrator import JobSpec
from orchestrator.errors import SpecError
from tests.support.hf import hf_family, raymesh_llama_from
from workers.model import hf_io
from workers.model.moe import BalancePool, MoELayer

TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
COEF = 0.02


def _lm_loss(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), TOKENS[:, 1:].flatten())


def _routers(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Each MoE layer's router gradient, by layer index (raymesh's router.weight, transformers' mlp.gate.weight)."""
    return {int(re.search(r"layers\.(\d+)\.", name).group(1)): p.grad for name, p in model.named_parameters()
            if name.endswith(("router.weight", "mlp.gate.weight"))}


def _ours(hf, balance_loss: str):
    moe = hf_io.config_fields(hf.config.to_dict())["moe"]
    ours = raymesh_llama_from(hf, moe={**moe, "balance_loss": balance_loss, "aux_loss_weight": COEF,
                                       "group": "microbatch"})
    _lm_loss(ours(TOKENS)).backward()  # the balance loss reaches the routers through the layers' backward
    return ours


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_pooled_balance_loss_and_its_router_gradients_are_transformers(kind):
    hf = hf_family(kind, output_router_logits=True, router_aux_loss_coef=COEF)
    out = hf(TOKENS, output_router_logits=True)
    (_lm_loss(out.logits) + COEF * out.aux_loss).backward()
    ours = _ours(hf, "pooled")
    figures = [layer.tally.get("loss_balance") for layer in ours.modules() if isinstance(layer, MoELayer)]
    assert figures[:-1] == [None] * (len(figures) - 1)  # the model's last MoE layer carries the pooled loss
    assert figures[-1].item() == pytest.approx(COEF * out.aux_loss.item(), rel=1e-5)
    theirs, grads = _routers(hf), _routers(ours)
    assert sorted(grads) == sorted(theirs) and len(grads) > 1
    for layer, grad in grads.items():
        torch.testing.assert_close(grad, theirs[layer], rtol=1e-4, atol=1e-7)
    per_layer = _routers(_ours(hf, "per_layer"))
    assert not all(torch.allclose(per_layer[i], theirs[i], rtol=1e-3, atol=1e-6) for i in theirs)


def test_a_stage_without_the_other_layers_is_refused_naming_the_field():
    pool = BalancePool([1, 3], 0.01)
    with pytest.raises(RuntimeError, match=r"balance_loss: pooled.*layers \[1\] ran elsewhere.*per_layer"):
        pool.add(3, torch.zeros(1, 4), torch.zeros(1, 4))


def _job(moe: dict, parallel: dict | None = None) -> JobSpec:
    return JobSpec.from_dict({"data": {"path": "/tmp/none"}, "run_dir": "/tmp/none", "parallel": parallel or {},
                              "train": {"microbatches": 2},
                              "model": {"arch": "llama", "d_model": 32, "n_heads": 4, "moe": moe}})


@pytest.mark.parametrize(("moe", "parallel", "message"), [
    ({"balance_loss": "pooled"}, {"pp": 2}, "model.moe.balance_loss.*parallel.pp=2.*balance_loss: per_layer"),
    ({"balance_loss": "pooled", "router": "switch"}, None, "model.moe.balance_loss.*router: switch"),
])
def test_pooled_where_it_cannot_be_formed_is_refused(moe, parallel, message):
    with pytest.raises(SpecError, match=message):
        _job(moe, parallel)


def test_pooled_gradients_are_the_same_under_full_recompute():
    """A layer's P leaves its checkpointed block through the pool; recompute must give it the same gradient."""
    from workers.model.registry import family
    from workers.parallel.recompute import apply_recompute

    hf = hf_family("qwen3_moe", output_router_logits=True, router_aux_loss_coef=COEF)
    plain = _routers(_ours(hf, "pooled"))
    moe = hf_io.config_fields(hf.config.to_dict())["moe"]
    ours = raymesh_llama_from(hf, moe={**moe, "balance_loss": "pooled", "aux_loss_weight": COEF,
                                       "group": "microbatch"})
    apply_recompute(ours, "full", family("llama"))
    _lm_loss(ours(TOKENS)).backward()
    for layer, grad in _routers(ours).items():
        torch.testing.assert_close(grad, plain[layer], rtol=1e-5, atol=1e-8)
