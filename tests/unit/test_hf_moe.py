"""Qwen3-MoE and Mixtral checkpoints as raymesh's Llama with ``model.moe`` (``workers.model.hf_moe``): what the
family tests (tests/unit/test_hf_families.py: logits within 1e-5, export round trip) do not cover: Qwen3-MoE
without renormalised gates, no token ever dropped, MoE layers where transformers puts them, each rank reading only
the experts it keeps, and refusals of what transformers would not compute, naming the key or field and the fix."""

from __future__ import annotations

import re

import pytest
import torch

from orchestrator import JobSpec
from orchestrator.errors import SpecError
from tests.support.hf import hf_family, raymesh_llama_from, save_hf_family
from workers.model import hf_io
from workers.model.config import ModelConfig
from workers.model.moe import MoELayer
from workers.model.registry import build_model
from workers.parallel.expert_parallel import keep_rows

TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))


def _close_to_transformers(hf, **fields):
    ours = raymesh_llama_from(hf, **fields)
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), hf(TOKENS).logits, rtol=1e-5, atol=1e-5)
    return ours


def test_qwen3_moe_without_renormalised_gates_matches_transformers():
    ours = _close_to_transformers(hf_family("qwen3_moe", norm_topk_prob=False))
    assert ours.cfg.moe.norm_topk is False
    renormalised = raymesh_llama_from(hf_family("qwen3_moe", norm_topk_prob=False), moe={**ours.cfg.moe.model_dump(),
                                                                                          "norm_topk": True})
    with torch.no_grad():
        assert not torch.allclose(renormalised(TOKENS), ours(TOKENS), atol=1e-3)  # the setting matters


def test_moe_layers_are_where_transformers_puts_them():
    ours = raymesh_llama_from(hf_family("qwen3_moe"))  # decoder_sparse_step 2: layers 1 and 3
    kinds = [isinstance(ours.layers[str(i)].feed_forward, MoELayer) for i in range(4)]
    assert kinds == [False, True, False, True]
    assert ours.layers["0"].feed_forward.w1.weight.shape == (48, 32)  # dense layers: intermediate_size
    assert ours.layers["1"].feed_forward.experts.w1.shape == (8, 32, 24)  # experts: moe_intermediate_size


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_no_token_is_dropped_whatever_the_capacity_factor(kind):
    """router topk has no capacity: a factor far below experts/top_k still routes every token as transformers."""
    hf = hf_family(kind)
    moe = hf_io.config_fields(hf.config.to_dict())["moe"]
    ours = _close_to_transformers(hf, moe={**moe, "capacity_factor": 0.1})
    layers = [m for m in ours.modules() if isinstance(m, MoELayer)]
    assert layers and all(float(layer.tally["dropped"]) == 0 for layer in layers)


@pytest.mark.parametrize(("kind", "experts"), [("qwen3_moe", 8), ("mixtral", 4)])
def test_each_expert_parallel_rank_reads_only_the_experts_it_keeps(kind, experts, tmp_path):
    src = save_hf_family(tmp_path, kind)
    cfg = ModelConfig(**{**hf_io.config_fields(hf_io.read_config(src)), "seq_len": 64})
    whole = build_model(cfg)
    hf_io.load_hf_weights(whole, src)
    half = build_model(cfg)
    for layer in (m for m in half.modules() if isinstance(m, MoELayer)):
        keep_rows(layer.experts, 1, 2)  # ep rank 1 of 2: the second half of the experts
    read = hf_io.load_hf_weights(half, src)
    ids = {int(m.group(1)) for m in (re.search(r"experts\.(\d+)\.", key) for key in read) if m}
    assert ids == set(range(experts // 2, experts))
    for name, value in half.state_dict().items():
        full = whole.state_dict()[name]
        assert torch.equal(value, full[experts // 2:] if ".experts." in name else full), name


def _config(kind: str, **overrides) -> dict:
    return hf_family(kind).config.to_dict() | overrides


@pytest.mark.parametrize(("kind", "overrides", "message"), [
    ("qwen3_moe", {"mlp_only_layers": [0, 1]}, r"mlp_only_layers makes layers \[1\] dense"),
    ("qwen3_moe", {"decoder_sparse_step": 8}, "decoder_sparse_step 8 leaves no MoE layer in 4 layers"),
    ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size 64 adds shared experts"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise 0.1 is not supported.*set router_jitter_noise: 0"),
])
def test_config_keys_raymesh_cannot_compute_are_refused_by_name(kind, overrides, message):
    with pytest.raises(ValueError, match=f"config.json {message}"):
        hf_io.config_fields(_config(kind, **overrides))


def test_mlp_only_layers_that_are_dense_anyway_are_accepted():
    assert hf_io.config_fields(_config("qwen3_moe", mlp_only_layers=[0, 2]))["moe"]["every"] == 2


def _model(model: dict):
    return JobSpec.from_dict({"data": {"path": "/tmp/none"}, "run_dir": "/tmp/none", "model": model}).model


SMALL = {"arch": "llama", "d_model": 32, "n_heads": 4}


@pytest.mark.parametrize(("moe", "field", "fix"), [
    ({"router": "noisy_topk"}, "model.moe.router", "disagrees with .*config.json, which gives moe.router = 'topk'"),
    ({"experts": 4}, "model.moe.experts", "gives moe.experts = 8.*remove model.moe.experts"),
    ({"bias_balancing": True}, "model.moe.bias_balancing", "set model.moe.bias_balancing: false"),
    ({"shared_experts": 1}, "model.moe.shared_experts", "no shared experts; fix: set model.moe.shared_experts: 0"),
])
def test_job_moe_settings_a_checkpoint_cannot_hold_are_refused(moe, field, fix, tmp_path):
    src = save_hf_family(tmp_path, "qwen3_moe")
    with pytest.raises(SpecError, match=f"{field}.*{fix}"):
        _model({"init_from": str(src), "moe": moe})


def test_the_jobs_own_training_settings_are_kept_over_the_checkpoints_shape(tmp_path):
    src = save_hf_family(tmp_path, "qwen3_moe")
    moe = _model({"init_from": str(src), "moe": {"aux_loss_weight": 0.001, "expert_dropout": 0.1}}).moe
    assert (moe.experts, moe.top_k, moe.d_expert, moe.every, moe.norm_topk) == (8, 2, 24, 2, True)
    assert (moe.aux_loss_weight, moe.expert_dropout) == (0.001, 0.1)


@pytest.mark.parametrize(("model", "field", "fix"), [
    ({"hf_model_type": "mixtral", "moe": {"every": 2}}, "model.moe.every", "experts in every layer.*every: 1"),
    ({"hf_model_type": "mixtral", "moe": {"norm_topk": False}}, "model.moe.norm_topk", "norm_topk: true"),
    ({"hf_model_type": "qwen3_moe", "qk_norm": True}, "model.moe", "mixture-of-experts family"),
    ({"moe": {"router": "gshard", "norm_topk": False}}, "model.moe.norm_topk", "read by router: topk only"),
])
def test_from_scratch_moe_families_are_checked_by_field(model, field, fix):
    with pytest.raises(SpecError, match=f"{field}.*{fix}"):
        _model({**SMALL, **model})


def test_moe_over_a_dense_checkpoint_is_refused(tmp_path):
    src = save_hf_family(tmp_path, "qwen3")
    with pytest.raises(SpecError, match="model.moe.*gives moe = None; fix: remove model.moe"):
        _model({"init_from": str(src), "moe": {"experts": 4}})


def test_an_export_refuses_a_learnt_balancing_bias(tmp_path):
    ours = raymesh_llama_from(hf_family("qwen3_moe"))
    ours.layers["1"].feed_forward.router.bias += 0.5
    with pytest.raises(ValueError, match="router.bias is model.moe.bias_balancing's learnt bias"):
        hf_io.write_hf(ours.state_dict(), ours.cfg, tmp_path / "out")


def test_an_export_carries_the_sources_aux_loss_settings_it_does_not_map(tmp_path):
    """router_aux_loss_coef weighs transformers' pooled balance loss, not raymesh's per-layer one (hf_moe): the job's
    aux_loss_weight trains, and the export keeps the source's coefficient for transformers' own training."""
    src = save_hf_family(tmp_path / "src", "mixtral", router_aux_loss_coef=0.02, output_router_logits=True)
    cfg = ModelConfig(**{**hf_io.config_fields(hf_io.read_config(src)), "seq_len": 64})
    assert cfg.moe.aux_loss_weight == 0.01  # raymesh's default, not the checkpoint's 0.02
    model = build_model(cfg)
    hf_io.load_hf_weights(model, src)
    config = hf_io.read_config(hf_io.write_hf(model.state_dict(), cfg, tmp_path / "out", source=src))
    assert (config["router_aux_loss_coef"], config["output_router_logits"]) == (0.02, True)
