"""Training data is what was prepared, or the job says it is not: the raw token cache is checked at every open and
built again when changed, shards and manifest counts are checked on the driver before any actor starts, and a
manifest without checksums is named in a warning."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec, check_before_start
from tests.support.damaged import flip_byte
from tests.support.events import recorded_events
from workers.data import TokenDataset, loader, prepare_data
from workers.data.raw_checksums import sums_path


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "doc.txt").write_bytes(np.random.default_rng(0).integers(32, 127, 50_000, np.uint8).tobytes())
    prepare_data([tmp_path / "src"], tmp_path / "data", shard_tokens=20_000)
    return tmp_path / "data"


def _stream(root: Path) -> np.ndarray:
    return TokenDataset(root, seq_len=32, seed=0).store.read(0, 50_000)


def _raw(root: Path) -> Path:
    return next(p for p in (root / loader.RAW_DIR).iterdir() if p.suffix == ".uint8")


def test_changed_bytes_in_the_raw_token_cache_are_found_and_built_again(corpus, caplog):
    """The cache every rank on the host trains from: one changed byte used to train other tokens without a word."""
    before = _stream(corpus)
    raw = _raw(corpus)
    flip_byte(raw, 12_345)
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        after = _stream(corpus)
    assert np.array_equal(after, before)
    assert f"raw token file {raw} changed since it was built: bytes [0, 50000) fail their sha256" in caplog.text


def test_a_raw_file_without_checksums_is_built_again(corpus, caplog):
    """One built by a raymesh from before the checksums: nothing says it holds the shards' tokens."""
    before = _stream(corpus)
    raw = _raw(corpus)
    sums_path(raw).unlink()
    raw.write_bytes(b"x" * raw.stat().st_size)
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        assert np.array_equal(_stream(corpus), before)
    assert "has no checksums" in caplog.text and sums_path(raw).is_file()


def test_a_changed_cache_in_a_folder_this_user_cannot_write_is_built_in_the_users_cache(corpus, tmp_path,
                                                                                       monkeypatch):
    before = _stream(corpus)
    flip_byte(_raw(corpus), 7)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    lock = corpus / loader.RAW_DIR
    real_open = open

    def no_write_there(file, mode="r", *args, **kwargs):
        if mode != "r" and Path(file).parent == lock:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(loader, "open", no_write_there, raising=False)
    ds = TokenDataset(corpus, seq_len=32, seed=0)
    assert ds.store.path.is_relative_to(tmp_path / "cache") and np.array_equal(ds.store.read(0, 50_000), before)


def _job(data: Path, tmp_path: Path) -> JobSpec:
    return JobSpec.from_dict({"data": {"path": str(data)}, "run_dir": str(tmp_path / "run"),
                              "model": {"seq_len": 16}, "train": {"global_batch_size": 4, "microbatches": 1}})


def _edit_manifest(root: Path, edit) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    edit(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(("edit", "says"), [
    (lambda m: m["shards"][1].update(tokens=m["shards"][1]["tokens"] + 1),
     "shard-00001.parquet holds 20,000 tokens, its entry in manifest.json says 20,001"),
    (lambda m: m.update(total_tokens=m["total_tokens"] - 1),
     "holds 50,000 tokens, its manifest.json total_tokens says 49,999"),
    (lambda m: m["shards"][0].pop("tokens"), "shards[0]"),
])
def test_a_manifest_count_off_by_one_is_refused_before_any_actor_starts(corpus, tmp_path, edit, says):
    _edit_manifest(corpus, edit)
    with pytest.raises(SpecError) as err:
        check_before_start(_job(corpus, tmp_path))
    assert err.value.field == "data.path" and says in str(err.value) and "prepare-data" in err.value.fix


def test_a_damaged_shard_is_refused_before_any_actor_starts(corpus, tmp_path):
    flip_byte(corpus / "shard-00002.parquet", 100)
    with pytest.raises(SpecError, match=r"shard-00002\.parquet fails its sha256 check .*; fix: run `raymesh "
                                        "prepare-data` again"):
        check_before_start(_job(corpus, tmp_path))


def test_a_cut_shard_without_checksums_is_refused_before_any_actor_starts(corpus, tmp_path):
    _edit_manifest(corpus, lambda m: [shard.pop("sha256") for shard in m["shards"]])
    path = corpus / "shard-00000.parquet"
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(SpecError, match=r"shard-00000\.parquet is not a Parquet file pyarrow can read"):
        check_before_start(_job(corpus, tmp_path))


def test_a_manifest_without_checksums_is_named_in_one_warning(corpus, tmp_path, caplog):
    _edit_manifest(corpus, lambda m: [shard.pop("sha256") for shard in m["shards"]])
    with recorded_events() as events:
        check_before_start(_job(corpus, tmp_path))
        check_before_start(_job(corpus, tmp_path))
    warned = [fields for name, fields in events if name == "data_unchecked"]
    assert len(warned) == 1 and warned[0]["manifest"] == f"{corpus}/manifest.json", events
    assert warned[0]["field"] == "data.path" and "prepare-data" in warned[0]["fix"]
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        TokenDataset(corpus, seq_len=32, seed=0)
        TokenDataset(corpus, seq_len=32, seed=0)
    assert caplog.text.count(f"{corpus / 'manifest.json'} lists shards without a sha256 checksum") == 1


def test_the_loader_refuses_a_manifest_missing_a_field_it_reads(corpus):
    _edit_manifest(corpus, lambda m: m.pop("vocab_size"))
    with pytest.raises(ValueError, match=rf"{corpus / 'manifest.json'} cannot be read: it has no vocab_size; fix: "):
        TokenDataset(corpus, seq_len=32, seed=0)
