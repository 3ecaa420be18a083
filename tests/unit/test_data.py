"""Byte-level data pipeline: shard round-trip, deterministic order, dp-independent resume."""

from __future__ import annotations

import json as jsonlib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from workers.data import DataCursor, TokenDataset, prepare_data

DOCS = {"a.txt": b"hello world\n", "sub/b.py": b"print('hi')\n" * 20, "sub/c.md": b"# title\n"}


def _write_docs(root: Path) -> None:
    for name, data in DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "skip.bin").write_bytes(b"\xff" * 50)  # non-matching extension


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    _write_sources(src)
    out = tmp_path_factory.mktemp("prepared")
    prepare_data([src], out, shard_tokens=1000)
    return out


def _write_sources(root: Path, offset: int = 32) -> None:
    """``data_dir``'s sources (``offset`` 32); another offset gives a corpus as long with other text."""
    _write_docs(root)
    (root / "z_big.txt").write_bytes(b"".join(bytes([i % 200 + offset]) for i in range(3000)))


def test_prepare_roundtrip(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _write_docs(src)
    manifest = prepare_data([src], tmp_path / "out", shard_tokens=100)
    expected = DOCS["a.txt"] + b"\x00" + DOCS["sub/b.py"] + b"\x00" + DOCS["sub/c.md"]
    assert manifest == jsonlib.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["format"] == "raymesh-bytes-v1" and manifest["vocab_size"] == 256
    assert manifest["total_tokens"] == len(expected)
    assert [s["file"] for s in manifest["shards"]] == [f"shard-{i:05d}.parquet" for i in range(3)]
    got = b""
    for shard in manifest["shards"]:
        table = pq.read_table(tmp_path / "out" / shard["file"])
        assert table.column_names == ["tokens"] and str(table.schema.field("tokens").type) == "uint8"
        assert table.num_rows == shard["tokens"] <= 100
        got += table.column("tokens").to_numpy().tobytes()
    assert got == expected


def test_prepare_skips_nested_site_packages(tmp_path: Path) -> None:
    (tmp_path / "lib" / "site-packages" / "pkg").mkdir(parents=True)
    (tmp_path / "lib" / "mod.py").write_bytes(b"x = 1\n")
    (tmp_path / "lib" / "site-packages" / "pkg" / "m.py").write_bytes(b"third party\n")
    assert prepare_data([tmp_path / "lib"], tmp_path / "a")["total_tokens"] == 6
    assert prepare_data([tmp_path / "lib" / "site-packages"], tmp_path / "b")["total_tokens"] == 12


def test_prepare_real_source_bounded(tmp_path: Path) -> None:
    src = Path(jsonlib.__file__).parent
    manifest = prepare_data([src], tmp_path, shard_tokens=12_000, max_tokens=30_000)
    assert manifest["total_tokens"] == 30_000
    assert [s["tokens"] for s in manifest["shards"]] == [12_000, 12_000, 6_000]
    first = pq.read_table(tmp_path / "shard-00000.parquet").column("tokens").to_numpy().tobytes()
    assert first.startswith((src / "__init__.py").read_bytes()[:1000])
    assert manifest == prepare_data([src], tmp_path, shard_tokens=12_000, max_tokens=30_000)


def test_overlapping_sources_prepare_each_file_once(tmp_path: Path) -> None:
    """A directory, one inside it and a file in it named again: each document once, as the directory alone."""
    src = tmp_path / "src"
    src.mkdir()
    _write_docs(src)
    alone = prepare_data([src], tmp_path / "alone")["total_tokens"]
    again = prepare_data([src, src / "sub", src / "a.txt"], tmp_path / "again")["total_tokens"]
    assert again == alone


@pytest.mark.parametrize("option, kwargs", [("--max-tokens", {"max_tokens": 0}),
                                            ("--shard-tokens", {"shard_tokens": -1})])
def test_a_token_count_that_is_not_positive_names_the_option_and_the_fix(tmp_path: Path, option, kwargs) -> None:
    with pytest.raises(ValueError, match=f"{option} -?[01] is not a positive token count; fix: give a positive"):
        prepare_data([tmp_path], tmp_path / "out", **kwargs)


def test_prepare_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.*pass an existing directory to --source"):
        prepare_data([tmp_path / "nope"], tmp_path / "out")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match=r"no tokens found.*empty.*\.py"):
        prepare_data([tmp_path / "empty"], tmp_path / "out")


def test_windows_share_boundary_token(data_dir: Path) -> None:
    ds = TokenDataset(data_dir, seq_len=16, seed=0)
    assert ds.num_samples == (len(ds.store) - 1) // 16
    ids = ds.global_sample_ids(0, 4)
    x, y = ds.batch(0, 4)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 16)
    for row, sid in enumerate(ids):
        window = torch.from_numpy(ds.store.read(int(sid) * 16, 17).astype(np.int64))
        assert torch.equal(x[row], window[:-1]) and torch.equal(y[row], window[1:])


def test_epoch_order_and_determinism(data_dir: Path) -> None:
    ds = TokenDataset(data_dir, seq_len=32, seed=7)
    n = ds.num_samples
    stream = ds.global_sample_ids(0, 2 * n)
    assert sorted(stream[:n]) == list(range(n)) and sorted(stream[n:]) == list(range(n))
    assert not np.array_equal(stream[:n], stream[n:])
    assert np.array_equal(stream[n:], np.random.default_rng([7, 1]).permutation(n))
    assert np.array_equal(ds.global_sample_ids(n - 3, 6), stream[n - 3 : n + 3])
    same = TokenDataset(data_dir, seq_len=32, seed=7)
    other = TokenDataset(data_dir, seq_len=32, seed=8)
    assert all(torch.equal(a, b) for a, b in zip(ds.batch(5, 8), same.batch(5, 8)))
    assert not torch.equal(ds.batch(5, 8)[0], other.batch(5, 8)[0])


def test_dp_ranks_partition_global_batch(data_dir: Path) -> None:
    ds = TokenDataset(data_dir, seq_len=16, seed=1)
    gb = 8
    for dp in (1, 2, 4):
        cursors = [DataCursor(ds, gb, r, dp) for r in range(dp)]
        for step in range(3):
            ids = [c.sample_ids_for_step() for c in cursors]
            inputs = torch.cat([c.next_batch()[0] for c in cursors])
            assert np.array_equal(np.concatenate(ids), ds.global_sample_ids(step * gb, gb))
            assert len(set(np.concatenate(ids).tolist())) == gb
            assert torch.equal(inputs, ds.batch(step * gb, gb)[0])
        assert all(c.position == 3 * gb for c in cursors)


def test_resume_at_different_dp_sees_each_sample_once(data_dir: Path) -> None:
    ds = TokenDataset(data_dir, seq_len=16, seed=3)
    gb = 8
    seen: list[int] = []
    before = [DataCursor(ds, gb, r, 4) for r in range(4)]
    for _ in range(3):
        for c in before:
            seen += c.sample_ids_for_step().tolist()
            c.next_batch()
    state = before[0].state_dict()
    assert state == {"position": 3 * gb, "seed": 3, "seq_len": 16, "global_batch": gb, "corpus": ds.corpus}
    after = [DataCursor(ds, gb, r, 2) for r in range(2)]
    for c in after:
        c.load_state_dict(state)
    steps = ds.num_samples // gb - 3
    for _ in range(steps):
        for c in after:
            seen += c.sample_ids_for_step().tolist()
            c.next_batch()
    assert seen == ds.global_sample_ids(0, len(seen)).tolist()
    assert len(seen) == len(set(seen)) == steps * gb + 3 * gb


def test_loader_errors(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.*raymesh prepare-data --out PATH"):
        TokenDataset(tmp_path / "missing", seq_len=8, seed=0)
    with pytest.raises(ValueError, match="seq_len=100000"):
        TokenDataset(data_dir, seq_len=100_000, seed=0)
    ds = TokenDataset(data_dir, seq_len=16, seed=0)
    with pytest.raises(ValueError, match="global_batch=10.*dp_size=4"):
        DataCursor(ds, 10, 0, 4)
    cursor = DataCursor(ds, 8, 0, 2)
    with pytest.raises(ValueError, match="seed=9.*seed=0.*fix: set data.seed: 9"):
        cursor.load_state_dict({"position": 8, "seed": 9, "seq_len": 16, "global_batch": 8})
    with pytest.raises(ValueError, match="seq_len=32.*seq_len=16.*fix: set model.seq_len: 32"):
        cursor.load_state_dict({"position": 8, "seed": 0, "seq_len": 32, "global_batch": 8})
    assert cursor.position == 0


def test_a_position_saved_over_another_corpus_is_refused(data_dir: Path, tmp_path: Path) -> None:
    """Prepared again from other sources, the same seed and seq_len give another order: the saved position would
    resume on samples the run has seen and skip others, so the cursor refuses it, naming the fix. The same corpus
    prepared again gives the same fingerprint; a checkpoint from before the fingerprint carries none."""
    for name, offset in (("other", 40), ("again", 32)):
        (tmp_path / name / "src").mkdir(parents=True)
        _write_sources(tmp_path / name / "src", offset)
        prepare_data([tmp_path / name / "src"], tmp_path / name / "out", shard_tokens=1000)
    other = TokenDataset(tmp_path / "other" / "out", seq_len=16, seed=0)
    ds = TokenDataset(data_dir, seq_len=16, seed=0)
    assert ds.num_samples == other.num_samples and ds.corpus != other.corpus
    saved = DataCursor(other, 8, 0, 1, position=24).state_dict()
    cursor = DataCursor(ds, 8, 0, 1)
    with pytest.raises(ValueError, match=rf"another corpus \(fingerprint {other.corpus}\).*fix: point data.path"):
        cursor.load_state_dict(saved)
    assert cursor.position == 0
    cursor.load_state_dict({k: v for k, v in saved.items() if k != "corpus"})
    assert cursor.position == 24
    assert TokenDataset(tmp_path / "again" / "out", seq_len=16, seed=0).corpus == ds.corpus


def test_a_changed_shard_fails_its_checksum_naming_the_shard(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _write_docs(src)
    manifest = prepare_data([src], tmp_path / "out", shard_tokens=100)
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])
    TokenDataset(tmp_path / "out", seq_len=8, seed=0)  # intact: loads
    other = tmp_path / "other"
    prepare_data([src / "sub"], other, shard_tokens=100)  # same layout, other bytes: still valid Parquet
    (tmp_path / "out" / "shard-00001.parquet").write_bytes((other / "shard-00001.parquet").read_bytes())
    with pytest.raises(ValueError, match=r"data shard .*shard-00001.parquet fails its sha256 check.*prepare-data"):
        TokenDataset(tmp_path / "out", seq_len=8, seed=0)


def test_the_cli_says_when_the_token_limit_cut_the_sources(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from orchestrator.cli import main

    _write_docs(tmp_path / "src")
    whole = sum(len(d) for d in DOCS.values()) + len(DOCS) - 1  # the documents and the separators between them
    for limit, cut in ((whole + 1, False), (whole - 1, True)):
        assert main(["prepare-data", "--source", str(tmp_path / "src"), "--out", str(tmp_path / "out"),
                     "--max-tokens", str(limit)]) == 0
        assert ("stopped at --max-tokens" in capsys.readouterr().out) is cut, limit


def _unlistable(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``os.walk`` unable to list ``folder``, as for a folder this user may not read (chmod does not stop root,
    who may run these tests, so the one call os.walk lists a folder with is refused instead)."""
    import os

    scandir = os.scandir

    def refuse(path=".", *args):
        if isinstance(path, (str, os.PathLike)) and Path(path) == folder:
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path, *args)

    monkeypatch.setattr(os, "scandir", refuse)


def test_unreadable_sources_are_counted_and_named_not_skipped_silently(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from orchestrator.cli import main

    src = tmp_path / "src"
    _write_docs(src)
    (src / "gone.txt").symlink_to(src / "deleted.txt")  # a broken link: a file that cannot be read
    assert "unreadable" not in prepare_data([src / "sub"], tmp_path / "readable")
    _unlistable(src / "sub", monkeypatch)
    manifest = prepare_data([src], tmp_path / "out")
    assert manifest["total_tokens"] == len(DOCS["a.txt"])  # sub/'s two files are not in it
    assert manifest["unreadable"] == {"files": 1, "folders": 1, "first": [
        f"{src / 'sub'} (Permission denied)", f"{src / 'gone.txt'} (No such file or directory)"]}
    assert main(["prepare-data", "--source", str(src), "--out", str(tmp_path / "cli")]) == 0
    err = capsys.readouterr().err
    assert "warning: 1 source file(s) and 1 folder(s) could not be read and are not in the data" in err
    assert str(src / "sub") in err and "fix: make them readable" in err


def test_sources_that_are_all_unreadable_are_refused_saying_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    (tmp_path / "src").mkdir()
    _unlistable(tmp_path / "src", monkeypatch)
    with pytest.raises(ValueError, match=r"no tokens found .* 0 source file\(s\) and 1 folder\(s\) could not be "
                                         r"read .*src \(Permission denied\); fix: make them readable"):
        prepare_data([tmp_path / "src"], tmp_path / "out")


def test_a_prepare_removes_the_staging_a_killed_prepare_left_and_no_other_folder(tmp_path: Path) -> None:
    """A prepare SIGKILLed while writing leaves its hidden staging folder in --out; the next prepare there removes
    it, and leaves every folder it cannot prove dead: a running prepare's, another host's (its pids are not this
    host's), one named before staging folders carried a pid, and the user's own."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import tempfile

    from workers import orphans

    out = tmp_path / "out"
    out.mkdir()
    killed = subprocess.run([sys.executable, "-c", (
        "import os, signal; from pathlib import Path; from workers.data.prepare import _staged\n"
        f"with _staged(Path({str(out)!r}), False) as staging:\n"
        "    (staging / 'shard-00000.parquet').write_bytes(b'half')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")], env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert killed.returncode == -signal.SIGKILL
    (left,) = out.glob(".prepare-*")
    dead = left.name.removeprefix(".prepare-").split("@")[0]  # the killed prepare's pid
    kept = [Path(tempfile.mkdtemp(prefix=orphans.owned_prefix(".prepare-"), dir=out)),  # running: this process
            out / f".prepare-{dead}@not-{socket.gethostname()}-x1",
            out / ".prepare-k3j2h1g0", out / ".prepare-notes"]
    for folder in kept[1:]:
        folder.mkdir()
    src = tmp_path / "src"
    _write_docs(src)
    prepare_data([src], out)
    assert not left.exists() and all(folder.is_dir() for folder in kept)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["manifest.json",
                                                                                  "shard-00000.parquet"]
