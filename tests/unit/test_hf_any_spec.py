"""``model.init_from`` of a Hugging Face causal LM raymesh has no family for becomes ``model.arch: hf``
(``workers.model.hf_any``): its shape read through transformers, its layers found without knowing the
architecture, and what needs the architecture refused before start, naming the field, the value and the fix."""

from __future__ import annotations

import json

import pytest
from torch import nn

from orchestrator.errors import SpecError
from orchestrator.spec.lora import _check_hf_layout
from tests.support.hf import save_hf_gpt2
from tests.support.jobs import tiny_spec
from workers.model.hf_any import HFCausalLM, blocks
from workers.model.registry import model_config

SHAPE_FREE = {"d_model": None, "n_layers": None, "n_heads": None, "d_ff": None}


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return save_hf_gpt2(tmp_path_factory.mktemp("gpt2"))


def _spec(token_data, tmp_path, hf_dir, model=None, **sections):
    return tiny_spec(token_data, tmp_path, model={**SHAPE_FREE, "init_from": str(hf_dir), **(model or {})},
                     **sections)


def test_a_gpt2_directory_becomes_arch_hf_with_its_shape(gpt2_dir, token_data, tmp_path):
    spec = _spec(token_data, tmp_path, gpt2_dir)
    m = spec.model
    assert (m.arch, m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.d_ff) == ("hf", 256, 32, 4, 4, 64)
    assert m.hf_config["model_type"] == "gpt2"
    _check_hf_layout(spec)  # export-hf accepts it (it refused every arch but llama)


@pytest.mark.parametrize(("parallel", "field", "value"), [
    ({"tp": 2}, "parallel.tp", 2), ({"pp": 2}, "parallel.pp", 2), ({"cp": 2}, "parallel.cp", 2)])
def test_tp_pp_cp_are_refused_naming_the_field_value_and_fix(gpt2_dir, token_data, tmp_path, parallel, field, value):
    with pytest.raises(SpecError) as caught:
        _spec(token_data, tmp_path, gpt2_dir, parallel={"device": "cpu", **parallel})
    assert caught.value.field == field and caught.value.value == value
    assert f"set {field}: 1" in str(caught.value) and "'gpt2'" in str(caught.value)


def test_a_context_longer_than_the_position_table_is_refused(gpt2_dir, token_data, tmp_path):
    with pytest.raises(SpecError, match="model.seq_len.*128.*longer than the 64 positions.*at most 64"):
        _spec(token_data, tmp_path, gpt2_dir, model={"seq_len": 128})


def test_a_field_that_disagrees_with_config_json_is_refused(gpt2_dir, token_data, tmp_path):
    with pytest.raises(SpecError, match="model.d_model.*disagrees"):
        _spec(token_data, tmp_path, gpt2_dir, model={"d_model": 64})


def test_arch_hf_without_init_from_is_refused(token_data, tmp_path):
    with pytest.raises(SpecError, match="model.arch.*'hf'.*set model.init_from"):
        tiny_spec(token_data, tmp_path, model={"arch": "hf"})


def test_a_model_type_transformers_cannot_build_is_refused_naming_init_from(token_data, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model", "vocab_size": 256}))
    with pytest.raises(SpecError, match="model.init_from.*'no-such-model'"):
        _spec(token_data, tmp_path, tmp_path)


@pytest.mark.parametrize(("kind", "config", "where"), [
    ("gpt2", {"n_embd": 32, "n_layer": 3, "n_head": 4}, "lm.transformer.h"),
    ("phi", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4},
     "lm.model.layers")])
def test_the_decoder_layers_are_found_without_knowing_the_architecture(kind, config, where):
    model = HFCausalLM(model_config({"arch": "hf", "hf_config": {"model_type": kind, "vocab_size": 64, **config}}))
    layers = blocks(model)
    assert len(layers) == 3 and layers == list(model.get_submodule(where))
    assert all(isinstance(layer, nn.Module) for layer in layers)
