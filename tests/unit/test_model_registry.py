"""The model registry: families are found by ``model.arch``; an unknown arch says what is registered."""

from __future__ import annotations

import pytest

from orchestrator.spec.model import ModelSpec
from workers.model.config import ModelConfig, model_config
from workers.model.gpt import GPT
from workers.model.registry import ModelFamily, build_model, families, family, register


def test_gpt_is_registered_and_builds_from_its_config():
    assert "gpt" in families()
    model = build_model(ModelConfig(d_model=32, n_heads=4, n_layers=2))
    assert isinstance(model, GPT) and len(model.layers) == 2
    assert family("gpt").hook("cut_stage").__name__ == "cut_stage"


def test_unknown_arch_names_the_field_and_the_registered_families():
    with pytest.raises(ValueError, match=r"model.arch 'llama' is not a registered model family; pick one of \['gpt'"):
        family("llama")


def test_a_second_family_plugs_in_by_registering():
    register(ModelFamily(arch="test-tiny", config=ModelConfig, build=GPT))
    assert family("test-tiny").build is GPT
    with pytest.raises(ValueError, match="already registered"):
        register(ModelFamily(arch="test-tiny", config=ModelConfig, build=lambda cfg: None))


def test_missing_hook_names_the_arch_and_the_step():
    with pytest.raises(KeyError, match="registers no 'pipeline_schedule' hook"):
        family("gpt").hook("pipeline_schedule")


def test_model_spec_declares_no_shape_field_of_its_own():
    """One declaration of the shape: the orchestrator's section adds only fine-tuning."""
    assert set(ModelSpec.model_fields) - set(ModelConfig.model_fields) == {"lora"}
    assert ModelSpec().arch == "gpt"


def test_model_config_takes_the_worker_dict_model_section():
    cfg = model_config({"d_model": 32, "n_heads": 4, "d_ff": 64, "lora": None})
    assert cfg.ffn_dim == 64 and cfg.head_dim == 8
