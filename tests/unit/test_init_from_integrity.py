"""`model.init_from` weights that do not fit, refused before any actor starts from the safetensors headers alone;
non-finite values, which only reading them shows, refused by the read itself naming the file and the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec, check_before_start
from tests.support.damaged import tiny_job
from tests.support.hf import save_hf_llama
from workers.model import hf_io

Q = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture
def setup(tmp_path: Path):
    """(job raw dict over prepared bytes, the HF directory it starts from)."""
    tiny_job(tmp_path)
    hf = save_hf_llama(tmp_path / "hf")
    raw = {"data": {"path": str(tmp_path / "data")}, "run_dir": str(tmp_path / "run"),
           "model": {"init_from": str(hf), "seq_len": 16}, "train": {"global_batch_size": 2, "microbatches": 1}}
    return raw, hf


def _rewrite(hf: Path, edit) -> None:
    tensors = load_file(hf / hf_io.SINGLE)
    edit(tensors)
    save_file(tensors, str(hf / hf_io.SINGLE), metadata={"format": "pt"})


def _refusal(raw: dict) -> SpecError:
    with pytest.raises(SpecError) as err:
        check_before_start(JobSpec.from_dict(raw))
    assert err.value.field == "model.init_from"
    return err.value


def test_intact_weights_pass(setup):
    raw, _ = setup
    check_before_start(JobSpec.from_dict(raw))


def test_a_cut_safetensors_file_is_refused_naming_it(setup):
    raw, hf = setup
    path = hf / hf_io.SINGLE
    path.write_bytes(path.read_bytes()[:-1000])
    err = _refusal(raw)
    assert f"{path} cannot be read as safetensors" in str(err) and "copy the checkpoint" in err.fix


def test_a_tensor_of_another_shape_is_refused_naming_it(setup):
    raw, hf = setup
    _rewrite(hf, lambda t: t.update({Q: t[Q][:, :16].contiguous()}))
    assert f"{Q} has shape [32, 16]" in str(_refusal(raw))


def test_integer_weights_are_refused_naming_the_tensor_not_cast(setup):
    """Cast, int32 values would load as weights of whole numbers: a quantized checkpoint's packed values."""
    raw, hf = setup
    _rewrite(hf, lambda t: t.update({Q: (t[Q] * 100).to(torch.int32)}))
    err = _refusal(raw)
    assert f"holds tensor {Q} as I32, not as a float" in str(err) and "unquantized" in err.fix


def _tied(hf: Path, head: str) -> None:
    """config.json says tied; the files keep an lm_head: the embedding's copy, or another matrix."""
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    if head == "same":
        _rewrite(hf, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))


def test_a_head_the_tied_model_would_drop_is_refused_naming_the_key_and_the_fix(setup):
    raw, hf = setup
    _tied(hf, "distinct")
    err = _refusal(raw)
    assert "holds lm_head.weight, a head other than model.embed_tokens.weight" in str(err)
    assert "set tie_word_embeddings: false" in err.fix and "remove lm_head.weight" in err.fix


def test_a_tied_checkpoint_that_keeps_a_copy_of_the_embedding_as_its_head_passes(setup):
    raw, hf = setup
    _tied(hf, "same")
    check_before_start(JobSpec.from_dict(raw))


def test_an_index_naming_a_missing_file_is_refused(tmp_path):
    tiny_job(tmp_path)
    hf = save_hf_llama(tmp_path / "hf", max_shard_size="20KB")
    shard = sorted(hf.glob("model-*.safetensors"))[-1]
    shard.unlink()
    raw = {"data": {"path": str(tmp_path / "data")}, "run_dir": str(tmp_path / "run"),
           "model": {"init_from": str(hf), "seq_len": 16}, "train": {"global_batch_size": 2, "microbatches": 1}}
    assert f"{shard} cannot be read as safetensors" in str(_refusal(raw))


def test_nan_weights_fail_the_read_naming_the_file_and_the_tensor(setup):
    """Headers cannot show NaN, so the driver passes them; the read each rank makes of its slice refuses them,
    where before the job trained NaN losses as bad batches until max_restarts ran out."""
    raw, hf = setup
    _rewrite(hf, lambda t: t[Q].__setitem__((3, 5), float("nan")))
    spec = JobSpec.from_dict(raw)
    check_before_start(spec)
    from workers.model.registry import build_model, model_config

    model = build_model(model_config({**spec.model.model_dump(), "d_ff": spec.model.ffn_dim}))
    with pytest.raises(ValueError, match=rf"{hf / hf_io.SINGLE} holds non-finite values \(NaN or inf\) in tensor {Q}"):
        hf_io.load_hf_weights(model, hf)
