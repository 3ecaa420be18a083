"""gpt-oss (``model.arch: gpt_oss``, ``workers.model.gpt_oss``) against ``transformers``' ``GptOssForCausalLM`` on the
same weights: logits, loss and every gradient (alternating windowed and full layers, sinks, YaRN, the clamped
SwiGLU and the biased router all acting), the export exact, the attention sinks in the blockwise kernel against
the plain softmax with an extra logit, config.json defaults as GptOssConfig's, the planner's count as
transformers', and what the family cannot compute refused by field. Layouts (tp2, pp2, dp2 x ep2):
tests/integration/test_gpt_oss_parity.py."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
import torch.nn.functional as F

from tests.support.cp_attention import sink_attention
from tests.support.hf import TINY_GPT_OSS, save_hf_gpt_oss
from workers.model import gpt_oss, hf_io
from workers.model.attention_blocks import blockwise_attention
from workers.model.registry import build_model, model_config

TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' tiny model, ours with its weights read as init_from reads them, the directory)."""
    hf, directory = save_hf_gpt_oss(tmp_path_factory.mktemp("gpt-oss") / "hf")
    ours = build_model(_config(directory))
    hf_io.load_hf_weights(ours, directory)
    return hf, ours.eval(), directory


def _config(directory, **changes):
    """The model config init_from gives, the balance loss off (transformers trains without it unless
    ``output_router_logits``; its gradient would otherwise reach the routers)."""
    fields = hf_io.config_fields(hf_io.read_config(directory))
    return model_config({**fields, "seq_len": 64, "moe": {**fields["moe"], "aux_loss_weight": 0.0}, **changes})


def _loss(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), TOKENS[:, 1:].flatten())


def test_logits_loss_and_gradients_equal_transformers(pair):
    hf, ours, _ = pair
    assert [layer.attention.core.window for layer in ours.layers.values()] == [6, None, 6, None]
    theirs, mine = _loss(hf(TOKENS).logits), _loss(ours(TOKENS))
    assert mine.item() == pytest.approx(theirs.item(), abs=1e-6)
    theirs.backward()
    mine.backward()
    grads = gpt_oss.to_hf_state({n: p.grad for n, p in ours.named_parameters()})
    expected = {n: p.grad for n, p in hf.named_parameters()}
    assert set(grads) == set(expected)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    hf.zero_grad()
    ours.zero_grad()


def test_the_driver_checks_every_tensor_from_the_headers(pair):
    """What ``raymesh run`` checks before any rank starts: a meta-device model takes every checkpoint tensor, of
    its on-disk shape (fused gate/up twice as wide); a missing one is refused by name."""
    _, ours, directory = pair
    with torch.device("meta"):
        meta = build_model(ours.cfg)
    names = hf_io.check_hf_weights(meta, directory)
    assert len(names) == len(list(ours.parameters())) and "model.layers.0.mlp.experts.gate_up_proj" in names
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    broken = directory.parent / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "config.json").write_text((directory / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if not k.endswith("self_attn.sinks")}, broken / "model.safetensors")
    with pytest.raises(ValueError, match="no tensor 'model.layers.0.self_attn.sinks'"):
        hf_io.check_hf_weights(meta, broken)


def test_the_clamps_and_the_window_change_the_logits(pair):
    """The check above means something: without the clamp or the window the model computes other logits."""
    _, ours, directory = pair
    for change in ({"swiglu_limit": 7.0}, {"sliding_window": None}, {"rope_yarn": None}):
        other = build_model(_config(directory, **change))
        other.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert not torch.allclose(other.eval()(TOKENS), ours(TOKENS), atol=1e-4), change


def test_export_is_the_source_checkpoint_and_loads_in_transformers(pair, tmp_path):
    from safetensors.torch import load_file
    from transformers import GptOssForCausalLM

    hf, ours, directory = pair
    out = hf_io.write_hf(ours.state_dict(), ours.cfg, tmp_path / "out", source=directory)
    source, written = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(written) == set(source)
    assert all(torch.equal(written[k], source[k]) for k in source)
    again = GptOssForCausalLM.from_pretrained(out).eval()
    again.config._attn_implementation = "eager"
    assert again.config.layer_types == hf.config.layer_types
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, hf(TOKENS).logits, rtol=0, atol=0)


def _sink_reference(q, k, v, sinks, window):
    """Eager attention with an extra logit per head (transformers' ``eager_attention_forward`` of gpt-oss)."""
    s = q.shape[2]
    diff = torch.arange(s)[:, None] - torch.arange(s)[None, :]
    return sink_attention(q, k, v, sinks, (diff >= 0) & (diff < (window or s + 1)))


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_in_the_blockwise_kernel_are_the_softmax_with_an_extra_logit(window):
    """Forward and every gradient, the sinks' own included, over grouped K/V heads and rows longer than a tile
    (``ROW_TILE``) would not be needed: the sink joins the online softmax's first state."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 40, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    out = blockwise_attention(q, k, v, None, window, sinks)
    ref = _sink_reference(q, k, v, sinks, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    dout = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    expected = torch.autograd.grad(ref, (q, k, v, sinks), dout)
    for name, a, b in zip("qkvs", grads, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_missing_config_keys_read_as_gpt_oss_config_fills_them(tmp_path):
    from transformers import AutoConfig

    kept = {"model_type": "gpt_oss", **{k: TINY_GPT_OSS[k] for k in hf_io.SIZE_KEYS}}
    (tmp_path / "config.json").write_text(json.dumps(kept))
    theirs = AutoConfig.from_pretrained(tmp_path).to_dict()
    ours = hf_io.config_fields(hf_io.read_config(tmp_path))
    assert ours == hf_io.config_fields(theirs)
    assert ours["rope_yarn"]["factor"] == 32.0 and ours["rope_theta"] == 150000.0 and ours["sliding_window"] == 128
    assert ours["n_kv_heads"] == 8 and ours["head_dim"] == 64 and ours["moe"]["experts"] == 128


def test_the_defaults_table_is_gpt_oss_configs():
    from transformers import GptOssConfig

    arguments = inspect.signature(GptOssConfig.__init__).parameters
    for key, value in gpt_oss.HF_DEFAULTS.items():
        if key == "rope_theta":
            assert GptOssConfig.default_theta == value
        elif key == "rope_parameters":
            assert GptOssConfig(num_hidden_layers=2).rope_parameters == {**value, "rope_theta": 150000.0}
        else:
            assert arguments[key].default == value, key


def test_the_planner_counts_what_transformers_builds():
    from transformers import GptOssConfig, GptOssForCausalLM

    from orchestrator import JobSpec
    from orchestrator.planning.estimate import stage_expert_params, stage_params

    def counted(model: dict) -> int:
        spec = JobSpec.from_dict({"data": {"path": "/tmp/none"}, "run_dir": "/tmp/none", "model": model})
        return sum(stage_params(spec, 0, 1)) + stage_expert_params(spec, 0, 1)

    tiny = {k: v for k, v in TINY_GPT_OSS.items() if k != "rope_parameters"}
    fields = gpt_oss.config_fields({**gpt_oss.HF_DEFAULTS, **tiny})
    assert counted({**fields, "seq_len": 32}) == GptOssForCausalLM(GptOssConfig(**tiny)).num_parameters()
    for preset, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)):
        with torch.device("meta"):
            theirs = GptOssForCausalLM(GptOssConfig(num_hidden_layers=layers, num_local_experts=experts))
        assert counted({"preset": preset}) == theirs.num_parameters()
    assert round(counted({"preset": "gpt-oss-20b"}) / 1e9, 1) == 20.9  # the model card's 20.9B and 116.8B
    assert round(counted({"preset": "gpt-oss-120b"}) / 1e9, 1) == 116.8


GPT_OSS = {"arch": "gpt_oss", "n_kv_heads": 2, "moe": {"experts": 4, "top_k": 2}}


@pytest.mark.parametrize(("model", "parallel", "message"), [
    ({"arch": "llama", "layer_types": ["full_attention"] * 4}, None, "model.layer_types.*gpt-oss field"),
    ({**GPT_OSS, "qkv_bias": True}, None, "model.qkv_bias.*gpt_oss does not read it"),
    ({**GPT_OSS, "layer_types": ["full_attention"]}, None, "model.layer_types.*1 attention kinds.*n_layers=4"),
    ({**GPT_OSS, "moe": None}, None, "model.moe.*every gpt_oss block"),
    ({**GPT_OSS, "moe": {"experts": 4, "router": "switch", "top_k": 1}}, None, "model.moe.router.*set .*topk"),
])
def test_what_gpt_oss_cannot_compute_is_refused_by_field(model, parallel, message):
    from orchestrator import JobSpec
    from orchestrator.errors import SpecError

    with pytest.raises((SpecError, ValueError), match=message):
        JobSpec.from_dict({"data": {"path": "/tmp/none"}, "run_dir": "/tmp/none", "parallel": parallel or {},
                           "model": {"d_model": 32, "n_heads": 4, **model}})


def test_sink_attention_compiles_whole_and_equals_eager():
    """The sinks' operator is opaque to Dynamo (``fullgraph`` traces around it), so a compiled gpt-oss block keeps
    its attention in the graph; output and every gradient, the sinks' included, equal eager's."""
    from workers.model.attention_blocks import blockwise_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 40, 8, generator=gen, requires_grad=True) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=gen, requires_grad=True)

    def attend(q, k, v, sinks):
        return blockwise_attention(q, k, v, None, 6, sinks)

    eager = attend(q, k, v, sinks)
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")(q, k, v, sinks)
    assert torch.equal(compiled, eager)
    for a, b in zip(torch.autograd.grad(eager.square().sum(), (q, k, v, sinks)),
                    torch.autograd.grad(compiled.square().sum(), (q, k, v, sinks)), strict=True):
        assert torch.equal(a, b)
