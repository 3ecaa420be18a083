"""`model.init_from` with a tokenizer.json: the data must be tokenized with it, refused before start otherwise."""

from __future__ import annotations

import json
import shutil

import pytest

from orchestrator.errors import SpecError
from orchestrator.spec.runtime_checks import check_before_start
from tests.support.hf import save_hf_llama
from tests.support.jobs import tiny_spec
from workers.data.tokenizer import TOKENIZER_FILE


def _hf_dir(tmp_path, bpe_token_data, tokenizer: dict | None):
    """A tiny HF checkpoint of the BPE data's vocabulary, shipping `tokenizer` (as tokenizer.json) if given."""
    vocab = json.loads((bpe_token_data / "manifest.json").read_text())["vocab_size"]
    src = save_hf_llama(tmp_path / "hf", vocab_size=vocab, intermediate_size=64, rope_scaling=None)
    if tokenizer is not None:
        (src / TOKENIZER_FILE).write_text(json.dumps(tokenizer))
    return src


def _bpe(bpe_token_data) -> dict:
    return json.loads((bpe_token_data / TOKENIZER_FILE).read_text())


def _swapped(tokenizer: dict) -> dict:
    """The same tokenizer with two tokens' ids exchanged: as large, but its ids mean other text."""
    vocab = tokenizer["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return tokenizer


def _check(data, src, tmp_path):
    check_before_start(tiny_spec(data, tmp_path, model={"init_from": str(src), "seq_len": 32}))


def test_bytes_data_for_a_checkpoint_with_a_tokenizer_is_refused(token_data, bpe_token_data, tmp_path):
    src = _hf_dir(tmp_path, bpe_token_data, _bpe(bpe_token_data))
    with pytest.raises(SpecError, match=r"data.path`: value .* holds ids of tokenizer bytes, but model.init_from "
                                        r".* its own tokenizer.json: the data is raw bytes; fix: prepare the data "
                                        r"with `raymesh prepare-data --tokenizer .*tokenizer.json"):
        _check(token_data, src, tmp_path)


def test_data_of_the_checkpoints_own_tokenizer_passes(bpe_token_data, tmp_path):
    _check(bpe_token_data, _hf_dir(tmp_path, bpe_token_data, _bpe(bpe_token_data)), tmp_path)
    shutil.rmtree(tmp_path / "hf")
    _check(bpe_token_data, _hf_dir(tmp_path, bpe_token_data, None), tmp_path)  # no tokenizer.json: nothing to check


def test_another_tokenizer_of_the_same_size_is_refused_by_its_hash(bpe_token_data, tmp_path):
    src = _hf_dir(tmp_path, bpe_token_data, _swapped(_bpe(bpe_token_data)))
    with pytest.raises(SpecError, match=r"tokenizer.json files differ in content"):
        _check(bpe_token_data, src, tmp_path)


def test_a_manifest_without_the_hash_is_checked_against_the_tokenizer_beside_it(bpe_token_data, tmp_path):
    """Data prepared before manifests recorded the hash still loads; the hash of its own tokenizer.json decides."""
    data = shutil.copytree(bpe_token_data, tmp_path / "old-data")
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["tokenizer"].pop("sha256")
    (data / "manifest.json").write_text(json.dumps(manifest))
    _check(data, _hf_dir(tmp_path, bpe_token_data, _bpe(bpe_token_data)), tmp_path)
    shutil.rmtree(tmp_path / "hf")
    with pytest.raises(SpecError, match=r"differ in content"):
        _check(data, _hf_dir(tmp_path, bpe_token_data, _swapped(_bpe(bpe_token_data))), tmp_path)
