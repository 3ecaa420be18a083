"""prepare-data's tokenizers: bytes, a trained BPE saved beside the shards, a given tokenizer.json."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from workers.data import TokenDataset, prepare_data
from workers.data.tokenizer import narrowest_dtype

SOURCE = Path(sysconfig.get_paths()["stdlib"]) / "json"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    prepare_data([SOURCE], out, tokenizer="bpe:600", shard_tokens=5_000)
    return out


def _ids(out: Path) -> np.ndarray:
    manifest = json.loads((out / "manifest.json").read_text())
    return np.concatenate([pq.read_table(out / s["file"])["tokens"].to_numpy() for s in manifest["shards"]])


def test_narrowest_unsigned_type_that_holds_the_ids():
    assert [narrowest_dtype(n).name for n in (256, 257, 65536, 65537)] == ["uint8", "uint16", "uint16", "uint32"]


def test_bytes_stay_the_default_and_the_manifest_says_so(tmp_path):
    manifest = prepare_data([SOURCE / "__init__.py"], tmp_path)
    assert manifest["tokenizer"] == {"kind": "bytes", "path": None, "vocab_size": 256, "eos_id": 0}
    assert (manifest["vocab_size"], manifest["dtype"]) == (256, "uint8")
    assert _ids(tmp_path).tobytes() == (SOURCE / "__init__.py").read_bytes()


def test_a_trained_bpe_is_saved_beside_the_shards_and_separates_documents_by_its_eos(bpe):
    from tokenizers import Tokenizer

    manifest = json.loads((bpe / "manifest.json").read_text())
    tok = manifest["tokenizer"]
    assert tok["kind"] == "bpe" and Path(tok["path"]) == bpe / "tokenizer.json"
    assert manifest["vocab_size"] == tok["vocab_size"] <= 600 and manifest["dtype"] == "uint16"
    assert len(manifest["shards"]) > 1  # documents run across shard boundaries
    ids = _ids(bpe)
    assert len(ids) == manifest["total_tokens"] and ids.max() < tok["vocab_size"]
    tokenizer = Tokenizer.from_file(tok["path"])
    docs = np.split(ids, np.flatnonzero(ids == tok["eos_id"]))
    texts = [tokenizer.decode(d[d != tok["eos_id"]].tolist()) for d in docs]
    sources = sorted(p for p in SOURCE.rglob("*") if p.suffix in (".py", ".txt", ".md", ".rst"))
    assert texts == [p.read_text() for p in sources]  # every document, in order, round-trips
    assert len(ids) < sum(p.stat().st_size for p in sources) / 2  # and BPE compresses the bytes


def test_a_given_tokenizer_json_is_used_as_is(bpe, tmp_path):
    manifest = prepare_data([SOURCE], tmp_path, tokenizer=str(bpe / "tokenizer.json"))
    assert manifest["tokenizer"]["kind"] == "file" and manifest["tokenizer"]["path"] == str(bpe / "tokenizer.json")
    assert np.array_equal(_ids(tmp_path), _ids(bpe))
    assert not (tmp_path / "tokenizer.json").exists()


def test_the_loader_reads_wide_ids(bpe):
    data = TokenDataset(bpe, seq_len=16, seed=0)
    inputs, targets = data.batch(0, 4)
    assert inputs.dtype.is_floating_point is False and int(inputs.max()) < data.vocab_size
    assert data.vocab_size == json.loads((bpe / "manifest.json").read_text())["vocab_size"]
    assert (inputs[:, 1:] == targets[:, :-1]).all()


@pytest.mark.parametrize("spec, message", [
    ("bpe:100", "SIZE must be an integer above 256"),
    ("bpe:lots", "SIZE must be an integer above 256"),
    ("nope.json", "is neither 'bytes', 'bpe:SIZE' nor an existing tokenizer.json"),
])
def test_bad_tokenizer_arguments_say_what_to_pass(tmp_path, spec, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        prepare_data([SOURCE], tmp_path, tokenizer=spec)


def test_a_tokenizer_without_an_end_of_document_token_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "t.json"))
    with pytest.raises(ValueError, match="has none of the end-of-document tokens"):
        prepare_data([SOURCE], tmp_path / "out", tokenizer=str(tmp_path / "t.json"))


def test_a_document_that_mentions_the_end_of_document_token_is_not_cut_by_it(bpe, tmp_path):
    text = 'SEP = "<|endoftext|>"  # GPT-2\'s separator\n'
    (tmp_path / "doc.py").write_text(text)
    manifest = prepare_data([tmp_path / "doc.py"], tmp_path / "out", tokenizer=str(bpe / "tokenizer.json"))
    ids = _ids(tmp_path / "out")
    assert manifest["tokenizer"]["eos_id"] not in ids  # one document: no end-of-document id at all
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(bpe / "tokenizer.json")).decode(ids.tolist()) == text


def test_a_document_holding_the_bytes_end_of_document_byte_is_refused_naming_file_and_offset(bpe, tmp_path):
    """Under --tokenizer bytes a NUL inside a file would be read as an end of document (the file silently cut in
    two): refused, naming the file and the offset, before anything is written. A tokenizer.json, whose
    end-of-document id is a special token, keeps the file one document."""
    sources = tmp_path / "src"
    sources.mkdir()
    (sources / "a.txt").write_text("plain text\n")
    (sources / "b.txt").write_bytes(b"header\x00\x01binary tail\n")
    with pytest.raises(ValueError, match=rf"{sources / 'b.txt'} holds byte 0x00 at offset 6, .*; fix: remove that "
                                         "byte from the file"):
        prepare_data([sources], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    manifest = prepare_data([sources / "b.txt"], tmp_path / "bpe-out", tokenizer=str(bpe / "tokenizer.json"))
    assert manifest["tokenizer"]["eos_id"] not in _ids(tmp_path / "bpe-out")  # one document, not two
