"""The `model:` section for Llamas: presets, `init_from`'s config.json and the errors that name field and fix."""

from __future__ import annotations

import pytest

from orchestrator import JobSpec
from orchestrator.cli import main
from orchestrator.errors import SpecError
from tests.support.hf import save_hf_llama


def _job(model: dict, **sections) -> JobSpec:
    return JobSpec.from_dict({"data": {"path": "/tmp/none"}, "run_dir": "/tmp/none", "model": model, **sections})


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_hf_llama(tmp_path_factory.mktemp("hf"), tie_word_embeddings=True)


def test_init_from_sets_the_shape_from_config_json(hf_dir):
    m = _job({"init_from": str(hf_dir), "seq_len": 32}).model
    assert (m.arch, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim) == ("llama", 32, 4, 4, 2, 48)
    assert m.tie_embeddings and m.rope_theta == 500000.0 and m.rope_scaling.original_max_position_embeddings == 16
    again = JobSpec.from_dict(_job({"init_from": str(hf_dir), "d_model": 32}).to_dict())  # agreeing fields pass
    assert again.model.d_model == 32


def test_a_field_disagreeing_with_config_json_names_both(hf_dir):
    with pytest.raises(SpecError, match=r"model.n_kv_heads`: value 4 disagrees with .*config.json, which gives "
                                        r"n_kv_heads = 2; fix: remove model.n_kv_heads"):
        _job({"init_from": str(hf_dir), "n_kv_heads": 4})


def test_init_from_without_config_json_is_refused(tmp_path):
    with pytest.raises(SpecError, match=r"model.init_from`: .* is not a readable Hugging Face model directory .*"
                                        r"no config.json"):
        _job({"init_from": str(tmp_path)})


def test_preset_and_init_from_together_are_refused(hf_dir):
    with pytest.raises(SpecError, match="model.preset`: value 'llama-1b' and model.init_from both set"):
        _job({"init_from": str(hf_dir), "preset": "llama-1b"})


def test_preset_fields_are_overridden_by_the_job():
    m = _job({"preset": "llama3-8b", "n_layers": 2, "seq_len": 128}).model
    assert (m.n_layers, m.seq_len, m.d_model, m.ffn_dim) == (2, 128, 4096, 14336)


def test_llama_fields_on_a_gpt_are_refused():
    with pytest.raises(SpecError, match=r"model.rope_theta`: value 500000.0 is a Llama-family field; .*"
                                        r"fix: set model.arch: llama"):
        _job({"rope_theta": 500000.0})


def test_tied_head_across_pipeline_stages_is_refused():
    with pytest.raises(SpecError, match="model.tie_embeddings`: value True with 2 pipeline stages"):
        _job({"arch": "llama", "tie_embeddings": True}, parallel={"pp": 2})


def test_export_hf_of_a_gpt_job_names_the_arch(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(f"data: {{path: {tmp_path}}}\nrun_dir: {tmp_path / 'run'}\n")
    assert main(["export-hf", str(job), "--out", str(tmp_path / "hf")]) == 2
    assert "model.arch`: value 'gpt' has no Hugging Face layout" in capsys.readouterr().err


def test_init_from_with_a_lora_base_checkpoint_is_refused(hf_dir, tmp_path):
    """Both name the base weights; the ranks would load the base checkpoint over init_from's without a word."""
    base = tmp_path / "base.pt"
    base.write_bytes(b"")
    with pytest.raises(SpecError, match=r"model.lora.base_checkpoint`: value .*base.pt.* and model.init_from .* "
                                        r"both give the base weights.*fix: remove model.lora.base_checkpoint"):
        _job({"init_from": str(hf_dir), "lora": {"rank": 4, "base_checkpoint": str(base)}})


def test_init_from_vocab_that_tp_does_not_divide_is_refused_before_start(tmp_path):
    """A checkpoint's vocabulary is not padded (padded head rows would change the softmax against transformers'),
    so tp must divide it: refused naming parallel.tp, the checkpoint's vocab_size and the tp values that work."""
    src = save_hf_llama(tmp_path / "hf", vocab_size=258, num_key_value_heads=4, rope_scaling=None)
    with pytest.raises(SpecError, match=r"parallel.tp`: value 4 does not divide vocab_size = 258 of "
                                        r"model.init_from .*config.json.*fix: pick parallel.tp from \[1, 2\]"):
        _job({"init_from": str(src)}, parallel={"tp": 4})
    assert _job({"init_from": str(src)}, parallel={"tp": 2}).padded_vocab_size == 258


def test_attention_dropout_of_config_json_is_refused_naming_the_key(tmp_path):
    """raymesh's Llama has no attention dropout: a checkpoint asking for it in training is refused, not ignored."""
    src = save_hf_llama(tmp_path / "hf", attention_dropout=0.1)
    with pytest.raises(SpecError, match=r"model.init_from`: .* holds a model raymesh's Llama cannot represent "
                                        r"\(config.json attention_dropout 0.1 is not supported.*set "
                                        r"attention_dropout: 0.0 in config.json"):
        _job({"init_from": str(src)})
    assert _job({"init_from": str(save_hf_llama(tmp_path / "zero", attention_dropout=0.0))}).model.arch == "llama"


def test_pad_token_id_comes_from_config_json_and_must_be_in_the_vocabulary(tmp_path):
    assert _job({"init_from": str(save_hf_llama(tmp_path / "hf", pad_token_id=5))}).model.pad_token_id == 5
    with pytest.raises(SpecError, match=r"model.pad_token_id`: value 256 is not an id of the vocabulary"):
        _job({"arch": "llama", "pad_token_id": 256})
    with pytest.raises(SpecError, match=r"model.pad_token_id`: value 5 is a Llama-family field"):
        _job({"pad_token_id": 5})
