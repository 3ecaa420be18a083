"""The streaming loader: windows read lazily equal the whole stream read at once (from a mapped raw file, by pread,
or by row groups), a rank's own allocations stay flat as the corpus grows 50x, a resumed cursor sees each sample
exactly once, and the corpus is decoded once per host, not once per window."""

from __future__ import annotations

import errno
import logging
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from workers.data import DataCursor, TokenDataset, loader, prepare, prepare_data, write_token_rows

ROWS = 4096  # small row groups, so windows straddle groups and shards often


def _refuse_raw_file(*args, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system")


@pytest.fixture(params=["mapped", "pread", "row groups"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each way the loader reads windows: the raw file mapped (small corpora), by pread (beyond MAP_LIMIT), and
    row group by row group (object storage, or a directory the raw file cannot be written into)."""
    if request.param == "pread":
        monkeypatch.setattr(loader, "MAP_LIMIT", 0)
    if request.param == "row groups":
        monkeypatch.setattr(loader.RawTokens, "build", _refuse_raw_file)
    return request.param


def _reader_of(ds: TokenDataset) -> str:
    if isinstance(ds.store, loader.ShardStore):
        return "row groups"
    return "pread" if ds.store.may_block else "mapped"


def _corpus(root: Path, tokens: int, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A prepared directory of ``tokens`` pseudo-random printable bytes, in shards of 64 Ki tokens."""
    src = root / "src"
    src.mkdir(parents=True)
    (src / "doc.txt").write_bytes((np.random.default_rng(0).integers(32, 127, tokens, dtype=np.uint8)).tobytes())
    monkeypatch.setattr(prepare, "ROW_GROUP_ROWS", ROWS)
    prepare_data([src], root / "out", shard_tokens=65_536)
    return root / "out"


def _whole_stream(root: Path) -> np.ndarray:
    """Every token, read the simple way (the old loader's): an independent reference for the lazy reads."""
    files = sorted(root.glob("shard-*.parquet"))
    return np.concatenate([pq.read_table(f).column("tokens").to_numpy() for f in files])


def test_lazy_windows_equal_the_whole_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str) -> None:
    root = _corpus(tmp_path, 200_000, monkeypatch)
    whole = _whole_stream(root)
    ds = TokenDataset(root, seq_len=100, seed=5)
    assert _reader_of(ds) == reader
    assert len(ds.store) == len(whole)
    x, y = ds.batch(0, ds.num_samples)  # every window, many across row-group and shard boundaries
    order = ds.global_sample_ids(0, ds.num_samples)  # one epoch: the slice path, against the permutation itself
    assert np.array_equal(order, np.random.default_rng([5, 0]).permutation(ds.num_samples))
    offsets = order[:, None] * 100 + np.arange(101)
    expected = whole[offsets].astype(np.int64)
    assert np.array_equal(x.numpy(), expected[:, :-1]) and np.array_equal(y.numpy(), expected[:, 1:])
    with pytest.raises(IndexError, match="outside the stream"):
        ds.store.read(len(whole) - 5, 10)


def _peak_loader_bytes(root: Path, steps: int) -> int:
    """Peak bytes the dataset and a cursor allocate (Python and numpy via tracemalloc, Arrow's pool beside it)."""
    arrow_before = pa.total_allocated_bytes()
    tracemalloc.start()
    try:
        cursor = DataCursor(TokenDataset(root, seq_len=64, seed=0), global_batch=16, dp_rank=0, dp_size=1)
        for _ in range(steps):
            cursor.next_batch()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak + max(pa.total_allocated_bytes() - arrow_before, 0)


def test_loader_memory_stays_flat_as_the_corpus_grows_50x(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = _corpus(tmp_path / "small", 200_000, monkeypatch)
    large = _corpus(tmp_path / "large", 50 * 200_000, monkeypatch)
    small_peak, large_peak = _peak_loader_bytes(small, 20), _peak_loader_bytes(large, 20)
    # what does grow: the epoch order (4 bytes a sample) and the footer index (16 bytes a row group)
    index_growth = 4 * (50 - 1) * 200_000 // 64 + 16 * (50 - 1) * 200_000 // ROWS
    assert large_peak < small_peak + 2 * index_growth + 256 * 1024, (small_peak, large_peak)
    assert large_peak < 50 * 200_000 / 4  # far below the corpus, which the old loader held whole


def test_resumed_cursors_with_prefetch_see_each_sample_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            reader: str) -> None:
    root = _corpus(tmp_path, 100_000, monkeypatch)
    ds = TokenDataset(root, seq_len=32, seed=2)
    assert _reader_of(ds) == reader  # a mapped file reads no batch ahead: its batches are read when asked for
    whole = _whole_stream(root)
    seen: list[int] = []

    def take(cursors: list[DataCursor]) -> None:
        for c in cursors:
            ids = c.sample_ids_for_step()
            x, _ = c.next_batch()
            expected = whole[ids[:, None] * 32 + np.arange(32)].astype(np.int64)
            assert np.array_equal(x.numpy(), expected)  # a prefetched batch is the one for this position
            seen.extend(ids.tolist())

    before = [DataCursor(ds, 8, r, 2) for r in range(2)]
    for _ in range(5):
        take(before)
    state = before[0].state_dict()
    after = [DataCursor(TokenDataset(root, seq_len=32, seed=2), 8, r, 4) for r in range(4)]
    for c in after:
        c.next_batch()  # a prefetch for position 0 is now pending: the load must not let it through
        c.load_state_dict(state)
    for _ in range(ds.num_samples // 8 - 5):
        take(after)
    assert len(seen) == len(set(seen)) == ds.num_samples // 8 * 8


def test_token_rows_become_a_stream_read_back_in_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 1000, int(n)) for n in rng.integers(1, 400, 60)]
    manifest = write_token_rows(iter(rows), tmp_path / "rows", vocab_size=1000, source="test", shard_tokens=3000)
    assert manifest["dtype"] == "uint16" and len(manifest["shards"]) > 1
    ds = TokenDataset(tmp_path / "rows", seq_len=10, seed=0)
    assert np.array_equal(ds.store.read(0, len(ds.store)), np.concatenate(rows))
    with pytest.raises(ValueError, match=r"token id 1000 is outside \[0, vocab_size=1000\).*fix"):
        write_token_rows(iter([np.array([5, 1000])]), tmp_path / "bad", vocab_size=1000, source="test")
    # a failed write over the stream leaves it as it was (staged, swapped in only once whole)
    with pytest.raises(ValueError, match="token id 1000"):
        write_token_rows(iter([np.array([5, 7]), np.array([1000])]), tmp_path / "rows", vocab_size=1000,
                         source="test", shard_tokens=1)
    with pytest.raises(ValueError, match="no tokens in the rows of test"):
        write_token_rows(iter([]), tmp_path / "rows", vocab_size=1000, source="test")
    again = TokenDataset(tmp_path / "rows", seq_len=10, seed=0)
    assert np.array_equal(again.store.read(0, len(again.store)), np.concatenate(rows))


def test_the_corpus_is_decoded_once_per_host_not_once_per_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """What makes the loader fast, counted (not timed): an epoch of random windows decodes each Parquet row group
    once, into the raw token file, and a second rank opening the directory decodes none; the row-group reader
    (object storage) decodes a group for most windows instead: in a random order its 64-group cache (of 245 here)
    rarely holds the next one."""
    root = _corpus(tmp_path, 1_000_000, monkeypatch)
    groups = 15 * (65_536 // ROWS) + -(-(1_000_000 - 15 * 65_536) // ROWS)
    decoded = []
    read_row_group = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                        lambda self, i, *a, **k: decoded.append(i) or read_row_group(self, i, *a, **k))

    def decodes_in_an_epoch() -> int:
        decoded.clear()
        ds = TokenDataset(root, seq_len=512, seed=0)
        cursor = DataCursor(ds, global_batch=32, dp_rank=0, dp_size=1)
        for _ in range(ds.num_samples // 32):
            cursor.next_batch()
        return len(decoded)

    assert decodes_in_an_epoch() == groups  # the first rank on the host builds the raw file
    assert decodes_in_an_epoch() == 0  # every later rank and run only opens it
    raw = next((root / loader.RAW_DIR).glob("*.uint8"))
    monkeypatch.setattr(loader.RawTokens, "build", _refuse_raw_file)
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        assert decodes_in_an_epoch() > 5 * groups  # 1,952 windows: 1,691 decodes
    assert f"cannot write {raw}" in caplog.text and "fix: make" in caplog.text


def test_a_cut_raw_file_is_built_again_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    root = _corpus(tmp_path, 100_000, monkeypatch)
    TokenDataset(root, seq_len=32, seed=0)
    raw = next((root / loader.RAW_DIR).glob("*.uint8"))
    with raw.open("r+b") as f:
        f.truncate(1000)
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        ds = TokenDataset(root, seq_len=32, seed=0)
    assert f"raw token file {raw} has 1000 bytes" in caplog.text and "building it again" in caplog.text
    assert np.array_equal(ds.store.read(0, 100_000), _whole_stream(root))


def test_a_re_prepared_corpus_reads_its_new_tokens_and_drops_the_old_raw_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _corpus(tmp_path, 100_000, monkeypatch)
    old = TokenDataset(root, seq_len=32, seed=0).store.read(0, 1000)
    (tmp_path / "src" / "doc.txt").write_bytes(b"x" * 100_000)
    prepare_data([tmp_path / "src"], root, shard_tokens=65_536)
    new = TokenDataset(root, seq_len=32, seed=0).store.read(0, 1000)
    assert not np.array_equal(old, new) and np.array_equal(new, _whole_stream(root)[:1000])
    assert len(list((root / loader.RAW_DIR).glob("*.uint8"))) == 1


def _read_only(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``root`` read-only to the loader. chmod does not stop root (these tests may run as root), so the two
    calls the loader writes there through are refused instead: ``Path.mkdir`` (the raw folder) and the loader's
    ``open`` (the build lock), as a read-only mount or another user's directory refuses them."""
    def refused(path) -> bool:
        return Path(path).resolve().is_relative_to(root.resolve())

    mkdir, open_ = Path.mkdir, open

    def no_mkdir(self: Path, *args, **kwargs):
        if refused(self):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return mkdir(self, *args, **kwargs)

    def no_write(file, mode: str = "r", *args, **kwargs):
        if mode != "r" and refused(file):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return open_(file, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", no_mkdir)
    monkeypatch.setattr(loader, "open", no_write, raising=False)


def _decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row groups decoded from now on, one entry each."""
    decoded: list[int] = []
    read_row_group = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                        lambda self, i, *a, **k: decoded.append(i) or read_row_group(self, i, *a, **k))
    return decoded


def test_a_read_only_data_directory_gets_its_raw_file_in_the_users_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared read-only storage: the raw file goes to $XDG_CACHE_HOME, is read like one beside the shards (same
    windows, same order), is built once (a second rank decodes nothing), and nothing is written into the data."""
    root = _corpus(tmp_path, 200_000, monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    before = sorted(root.rglob("*"))
    _read_only(root, monkeypatch)
    decoded = _decodes(monkeypatch)
    ds = TokenDataset(root, seq_len=100, seed=5)
    assert isinstance(ds.store, loader.RawTokens) and ds.store.path.is_relative_to(tmp_path / "cache")
    x, _ = ds.batch(0, ds.num_samples)
    order = np.random.default_rng([5, 0]).permutation(ds.num_samples)
    assert np.array_equal(x.numpy(), _whole_stream(root)[order[:, None] * 100 + np.arange(100)])
    built = len(decoded)
    assert TokenDataset(root, seq_len=100, seed=5).store.path == ds.store.path and len(decoded) == built
    assert sorted(root.rglob("*")) == before


def test_a_raw_file_another_user_built_in_a_read_only_directory_is_opened(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data's owner trained on it first, so its raw file is beside the shards, but this user may not take the
    build lock there: the file is opened as it is (it only ever appears whole), nothing decoded, nothing cached."""
    root = _corpus(tmp_path, 100_000, monkeypatch)
    owners = TokenDataset(root, seq_len=32, seed=0).store.path
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _read_only(root, monkeypatch)
    decoded = _decodes(monkeypatch)
    assert TokenDataset(root, seq_len=32, seed=0).store.path == owners
    assert decoded == [] and not (tmp_path / "cache").exists()


def test_ranks_building_the_raw_file_at_once_decode_the_corpus_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks of a host start together: the file lock lets one build while the other waits, then opens it."""
    root = _corpus(tmp_path, 200_000, monkeypatch)
    decoded = _decodes(monkeypatch)
    with ThreadPoolExecutor(2) as pool:
        stores = list(pool.map(lambda _: TokenDataset(root, seq_len=32, seed=0).store, range(2)))
    full = 200_000 // 65_536  # whole shards, then the rest in one
    assert stores[0].path == stores[1].path
    assert len(decoded) == full * (65_536 // ROWS) + -(-(200_000 - full * 65_536) // ROWS)  # both ranks together
    assert np.array_equal(stores[0].read(0, len(stores[0])), stores[1].read(0, len(stores[1])))
