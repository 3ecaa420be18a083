"""Qwen3, Qwen2 and Mistral checkpoints as raymesh's one Llama (``workers.model.hf_io.FAMILIES``): the same
logits as ``transformers``' own model (float32, 1e-5), an export ``AutoModelForCausalLM`` loads as the same
family with identical weights, sliding windows every layer uses (``model.sliding_window``), and refusals of what
the Llama does not compute (a window only some layers use, when it cuts)."""

from __future__ import annotations

import json

import pytest
import torch

from orchestrator import JobSpec
from orchestrator.errors import SpecError
from tests.support.hf import TINY_FAMILIES, hf_family, raymesh_llama_from, save_hf_family
from workers.model import hf_io
from workers.model.config import ModelConfig
from workers.model.registry import build_model

TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(TINY_FAMILIES))
def test_logits_equal_transformers(kind):
    hf = hf_family(kind)
    ours = raymesh_llama_from(hf)
    assert ours.cfg.hf_model_type == kind
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), hf(TOKENS).logits, rtol=1e-5, atol=1e-5)


def test_qwen3_heads_are_wider_than_d_model_over_n_heads_and_normed():
    ours = raymesh_llama_from(hf_family("qwen3"))
    attention = ours.layers["0"].attention
    assert ours.cfg.head_size == 16 != ours.cfg.d_model // ours.cfg.n_heads
    assert attention.wq.weight.shape == (64, 32) and attention.wo.weight.shape == (32, 64)
    assert attention.q_norm.weight.shape == (16,) and ours.output.weight is ours.tok_embeddings.weight


def test_qwen2_biases_are_read_and_start_at_zero():
    ours = raymesh_llama_from(hf_family("qwen2"))
    attention = ours.layers["0"].attention
    assert attention.wq.bias.abs().sum() > 0 and attention.wo.bias is None
    torch.manual_seed(0)
    fresh = build_model(ours.cfg)
    assert torch.equal(fresh.layers["1"].attention.wk.bias, torch.zeros(16))


@pytest.mark.parametrize("kind", list(TINY_FAMILIES))
def test_init_from_and_export_round_trip_through_transformers(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    src = save_hf_family(tmp_path / "src", kind)
    cfg = ModelConfig(**{**hf_io.config_fields(hf_io.read_config(src)), "seq_len": 64})
    model = build_model(cfg)
    hf_io.load_hf_weights(model, src)
    out = hf_io.write_hf(model.state_dict(), cfg, tmp_path / "out", source=src)
    config = json.loads((out / hf_io.CONFIG).read_text())
    assert config["model_type"] == kind and config["architectures"] == [hf_io.FAMILIES[kind].architecture]
    exported, original = (AutoModelForCausalLM.from_pretrained(d) for d in (out, src))
    assert type(exported) is type(original)
    assert exported.state_dict().keys() == original.state_dict().keys()
    for name, value in original.state_dict().items():
        assert torch.equal(exported.state_dict()[name], value), name
    with torch.no_grad():
        torch.testing.assert_close(exported(TOKENS).logits, model(TOKENS), rtol=1e-5, atol=1e-5)


def _job_model(model: dict):
    """The ``model:`` section of a job file holding ``model`` (through ``JobSpec.from_dict``, as a job file is)."""
    return JobSpec.from_dict({"data": {"path": "/tmp/none"}, "run_dir": "/tmp/none", "model": model}).model


def _spec_from(directory, **model):
    return _job_model({"init_from": str(directory), **model})


@pytest.mark.parametrize(("kind", "overrides"), [
    ("qwen3", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 32, "layer_types": ["full_attention"] * 3
               + ["sliding_attention"]}),
])
def test_a_window_only_some_layers_use_is_refused_when_it_cuts_naming_the_key_and_the_fix(kind, overrides, tmp_path):
    src = save_hf_family(tmp_path, kind, **overrides)
    with pytest.raises(SpecError, match="config.json use_sliding_window true .*only 32 tokens, less than "
                                        "model.seq_len 64.*set model.seq_len to at most 32"):
        _spec_from(src, seq_len=64)
    assert _spec_from(src, seq_len=32).seq_len == 32  # a window as long as the sequence cuts nothing


@pytest.mark.parametrize(("kind", "overrides"), [
    ("mistral", {"sliding_window": 10}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 10, "max_window_layers": 0}),
])
def test_a_window_every_layer_uses_gives_the_logits_of_transformers_at_4x_its_length(kind, overrides, tmp_path):
    """``model.sliding_window`` read from config.json: 40 tokens through a 10-token window equal ``transformers``
    (1e-5), and differ from the same weights without the window (the window cuts)."""
    hf = hf_family(kind, **overrides)
    ours = raymesh_llama_from(hf)
    assert ours.cfg.sliding_window == 10
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), hf(TOKENS).logits, rtol=1e-5, atol=1e-5)
        unwindowed = raymesh_llama_from(hf, sliding_window=None)
        assert (unwindowed(TOKENS) - hf(TOKENS).logits).abs().max() > 1e-3
    assert _spec_from(save_hf_family(tmp_path, kind, **overrides), seq_len=64).sliding_window == 10


def test_a_windowed_model_exports_the_window_transformers_applies(tmp_path):
    """A Mistral with ``model.sliding_window`` exports its window in config.json; a Llama-typed one is refused
    (LlamaForCausalLM has no window), naming the field and the fix."""
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(**{**hf_io.config_fields(hf_family("mistral").config.to_dict()), "seq_len": 64,
                         "sliding_window": 10})
    model = build_model(cfg)
    out = hf_io.write_hf(model.state_dict(), cfg, tmp_path / "out")
    assert json.loads((out / hf_io.CONFIG).read_text())["sliding_window"] == 10
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out)(TOKENS).logits, model(TOKENS),
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="model.sliding_window 10 cannot be written as a Hugging Face llama .*"
                                         "set model.hf_model_type: mistral"):
        hf_io.hf_config(cfg.model_copy(update={"hf_model_type": "llama"}))


def test_a_qwen_window_no_layer_uses_is_accepted(tmp_path):
    src = save_hf_family(tmp_path, "qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=4)
    assert _spec_from(src, seq_len=64).qk_norm


def test_an_unknown_model_type_names_the_supported_ones():
    config = hf_family("qwen2").config.to_dict() | {"model_type": "gemma"}
    with pytest.raises(ValueError, match="model_type 'gemma' is not supported; raymesh reads Hugging Face 'llama', "
                                         "'mistral', 'qwen2', 'qwen3'"):
        hf_io.config_fields(config)


@pytest.mark.parametrize(("kind", "key", "value"), [
    ("qwen3", "intermediate_size", None),  # was read as d_ff unset: raymesh's default width, not the weights'
    ("qwen3", "hidden_size", None),  # was a bare TypeError
    ("qwen2", "num_attention_heads", 0),  # was a ZeroDivisionError
    ("qwen3_moe", "moe_intermediate_size", None),  # was the dense width for the experts
    ("qwen3_moe", "decoder_sparse_step", None),
    ("mixtral", "num_experts_per_tok", "2"),
])
def test_a_null_or_bad_size_in_config_json_is_refused_naming_the_key(kind, key, value):
    config = hf_family(kind).config.to_dict() | {key: value}
    with pytest.raises(ValueError, match=f"config.json {key} {value!r} is not a positive whole number"):
        hf_io.config_fields(config)
    del config[key]
    if key != "decoder_sparse_step":  # transformers' default of 1 applies when it is left out
        with pytest.raises(ValueError, match=f"config.json has no {key}"):
            hf_io.config_fields(config)


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_rotary_settings_that_are_not_an_object_are_refused_naming_the_key(key):
    config = hf_family("qwen3").config.to_dict() | {"rope_scaling": None, key: ["llama3", 8.0]}
    with pytest.raises(ValueError, match=rf"config.json {key} \['llama3', 8.0\] is not an object"):
        hf_io.config_fields(config)


def test_a_null_head_dim_or_kv_heads_reads_as_transformers_derives_them():
    config = hf_family("qwen2").config.to_dict() | {"head_dim": None, "num_key_value_heads": None}
    fields = hf_io.config_fields(config)
    assert fields["head_dim"] is None and fields["n_kv_heads"] == config["num_attention_heads"]


def test_qwen3_attention_bias_is_refused_naming_the_key():
    config = hf_family("qwen3").config.to_dict() | {"attention_bias": True}
    with pytest.raises(ValueError, match="config.json attention_bias: true is not supported"):
        hf_io.config_fields(config)


@pytest.mark.parametrize(("model", "field", "fix"), [
    ({"head_dim": 7}, "model.head_dim", "even width"),
    ({"hf_model_type": "qwen3"}, "model.qk_norm", "set model.qk_norm: true"),
    ({"hf_model_type": "qwen2", "qk_norm": True}, "model.qkv_bias", "set model.qkv_bias: true"),
    ({"qkv_bias": True}, "model.qkv_bias", r"hf_model_type to one of \['qwen2'\]"),
])
def test_family_fields_that_disagree_are_refused_by_field(model, field, fix):
    with pytest.raises(SpecError, match=f"{field}.*{fix}"):
        _job_model({"arch": "llama", "d_model": 32, "n_heads": 4, **model})


def test_a_gpt_refuses_the_families_fields():
    with pytest.raises(SpecError, match="model.qk_norm.*Llama-family field"):
        _job_model({"qk_norm": True})


PLANNED = {"qwen3": {"head_dim": 16, "qk_norm": True, "tie_embeddings": True},
           "qwen2": {"qkv_bias": True}, "mistral": {"head_dim": 4},
           # experts narrower than the dense layers, every other layer: d_expert counted, not d_ff
           "qwen3_moe": {"head_dim": 16, "qk_norm": True, "moe": {"experts": 8, "top_k": 2, "d_expert": 24,
                                                                  "every": 2, "norm_topk": False}},
           "mixtral": {"moe": {"experts": 4, "top_k": 2}}}


@pytest.mark.parametrize("kind", list(PLANNED))
def test_the_planner_counts_the_parameters_the_model_has(kind):
    from orchestrator.planning.estimate import stage_expert_params, stage_params
    from orchestrator.planning.layout_search import Shape
    from workers.spec import WorkerSpec

    spec = JobSpec.from_dict({"data": {"path": "/tmp/none"}, "run_dir": "/tmp/none", "parallel": {"tp": 2},
                              "model": {"arch": "llama", "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_ff": 48,
                                        "hf_model_type": kind, **PLANNED[kind]}})
    with torch.device("meta"):
        built = sum(p.numel() for p in build_model(WorkerSpec.from_dict(spec.worker_dict()).model).parameters())
    assert sum(stage_params(spec, 0, 1)) + stage_expert_params(spec, 0, 1) == built  # routed experts apart
    if spec.model.moe is None:
        assert Shape.of(spec).params == built  # the layout search's dense shape


def test_activations_follow_head_dim():
    """Qwen3's heads twice as wide save twice the q/k/v/output elements of d_model / n_heads heads."""
    from orchestrator.planning import memory_model as mm

    narrow, wide = (mm.layer_activation_bytes(64, 1, 32, 4, 48, kv_heads=2, family="llama", head_dim=hd)
                    for hd in (8, 16))
    # q/k/v/output elements, and the rotary cos/sin tables (half a head wide, float32, one pair per q and k call)
    assert wide - narrow == 4 * 64 * (2 * 4 * 8 + 2 * 2 * 8) + 4 * 4 * 64 * 8 // 2


def test_a_merged_lora_state_of_qwen2_keeps_its_biases(tmp_path):
    from transformers import AutoModelForCausalLM

    from workers.contract.sections import LoraSection
    from workers.model.lora import apply_lora, merged_state_dict

    ours = raymesh_llama_from(hf_family("qwen2"))
    apply_lora(ours, LoraSection(targets=["wq", "wk", "wv"], rank=2, alpha=4.0), 0)
    out = hf_io.write_hf(merged_state_dict(ours), ours.cfg, tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out)(TOKENS).logits, ours(TOKENS),
                                   rtol=1e-5, atol=1e-5)
