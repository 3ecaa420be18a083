"""`raymesh generate` decodes with the tokenizer the data was prepared with, or refuses: a tokenizer.json swapped
beside the shards used to decode the model's ids into fluent garbage without a word."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.damaged import sealed_checkpoint, tiny_job
from workers.data.tokenizer import train_bpe

MODEL = "  seq_len: 16\n  d_model: 32\n  n_layers: 1\n  n_heads: 2\n  d_ff: 64\n  vocab_size: 320\n"


@pytest.fixture
def bpe_job(tmp_path):
    job = tiny_job(tmp_path, model=MODEL, tokenizer="bpe:300")
    sealed_checkpoint(job)
    return job


def _generate(job, capsys) -> tuple[int, str]:
    from orchestrator.cli.commands import main

    code = main(["generate", str(job), "--max-new-tokens", "3", "--seed", "1"])
    return code, capsys.readouterr().err


def test_the_recorded_tokenizer_generates(bpe_job, capsys):
    code, err = _generate(bpe_job, capsys)
    assert code == 0, err


def test_a_swapped_tokenizer_is_refused_naming_the_file_both_digests_and_the_fix(bpe_job, tmp_path, capsys):
    tokenizer = tmp_path / "data" / "tokenizer.json"
    recorded = json.loads((tmp_path / "data" / "manifest.json").read_text())["tokenizer"]["sha256"]
    train_bpe([b"completely other text, other merges " * 40], 300, tokenizer)  # same size, other ids
    code, err = _generate(bpe_job, capsys)
    assert code == 2 and f"{tokenizer} has sha256 " in err and f"the manifest records {recorded}" in err, err
    assert "`data.path`" in err and "put back the tokenizer.json" in err and "Traceback" not in err


def test_without_a_recorded_digest_the_vocabulary_still_tells(bpe_job, tmp_path, capsys):
    """A manifest from before the digest: another vocabulary size is still caught."""
    manifest = tmp_path / "data" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["tokenizer"].pop("sha256")
    manifest.write_text(json.dumps(data))
    train_bpe([b"completely other text, other merges " * 40], 290, tmp_path / "data" / "tokenizer.json")
    code, err = _generate(bpe_job, capsys)
    assert code == 2 and re.search(r"tokenizer\.json has vocab_size \d+, but the manifest records \d+", err), err


def test_a_tokenizer_file_that_is_not_one_is_refused(bpe_job, tmp_path, capsys):
    (tmp_path / "data" / "tokenizer.json").write_text("{not json")
    code, err = _generate(bpe_job, capsys)
    assert code == 2 and "is not a tokenizer file" in err and "Traceback" not in err, err
