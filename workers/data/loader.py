"""Deterministic, resumable sample stream over prepared token shards (bytes, or any tokenizer's ids).

The global order (epoch permutations seeded by [seed, epoch]) is independent of the
data-parallel layout; ranks only pick contiguous slices of it. Hence a checkpoint's
`position` alone says which samples were consumed, whatever dp size resumes it.

A local directory's token stream is decoded once per host into one raw token file beside the shards, or, where
the data directory is read-only (shared storage, another user's folder), in the user's cache (`raw_folders`,
`RawTokens`): a batch is then one gather from the file memory-mapped (up to `MAP_LIMIT`) or one pread per
window. An object-store prefix (`workers.storage`) is read lazily, the row groups a window spans with a bounded
cache (`ShardStore`). Where a read may wait on I/O the next step's batch is read on a background thread
(`Prefetch`). Either way a rank's memory does not grow with the corpus.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import logging
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from workers.data import blend, checksums, raw_checksums
from workers.data.manifest import manifest_problem
from workers.data.prepare import FORMAT, LOSS_MASK, PREFERENCE
from workers.data.tokenizer import manifest_eos_id
from workers.parallel.context_layout import split_sequence
from workers.storage import is_url, location, parquet_source

_MISSING_HINT = "run `raymesh prepare-data --out PATH` first or set data.path"
log = logging.getLogger(__name__)
RAW_DIR = ".raw-tokens"  # beside the shards: deleted with them, and shared by every rank and run on the host
CACHE_DIR = "raymesh/raw-tokens"  # under $XDG_CACHE_HOME (~/.cache): where a read-only data directory's raw file goes
# A raw token file up to this size is memory-mapped whole (a window is then a gather, as fast as the old in-memory
# loader); a larger one is read by one pread per window, so that no rank maps more than this of its corpus.
MAP_LIMIT = 64 << 20
IGNORE_INDEX = -100  # a target no loss counts (F.cross_entropy's default ignore_index): a prompt token's


def _refuse(problem: str | None) -> None:
    """A data directory's shards against its manifest (``workers.data.checksums``): a problem is refused with
    the fix."""
    if problem is not None:
        raise ValueError(f"{problem}; fix: {checksums.REPREPARE}")


def _check_range(start: int, length: int, total: int) -> None:
    if start < 0 or start + length > total:
        raise IndexError(f"tokens [{start}, {start + length}) outside the stream of {total}")


class ShardStore:
    """Random access to the token stream of a prepared directory, one Parquet row group at a time.

    Why our own: a window is `seq_len + 1` tokens anywhere in the corpus, and neither pyarrow's datasets nor
    ``ray.data`` offer random access by global row. Up front every shard's bytes are checked against the
    manifest's checksum (streamed, 1 MiB at a time) and only its footer is kept (row-group sizes); a window then
    decodes the one or two row groups it spans. At most ``cache_groups`` decoded groups and ``open_files``
    open shards are kept (least recently used first out), so a rank holds ``cache_groups`` x ``ROW_GROUP_ROWS``
    tokens whatever the corpus size.
    """

    def __init__(self, root: Path, manifest: dict, cache_groups: int = 64, open_files: int = 4) -> None:
        self.root = root
        self.column = "tokens"  # the Parquet column read (`column_view`: the loss mask's)
        self._names = [root / shard["file"] for shard in manifest["shards"]]
        self._files: OrderedDict[int, pq.ParquetFile] = OrderedDict()
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._limits = {"cache": cache_groups, "files": open_files}
        self._lock = threading.Lock()  # the prefetch thread and the step thread share the caches
        self.may_block = True  # a read decodes, and may wait on an object store: worth reading ahead
        groups, starts = [], [0]
        for index, shard in enumerate(manifest["shards"]):
            checksums.verify_shard(root, shard)
            source, fs = parquet_source(self._names[index])
            meta = pq.read_metadata(source, filesystem=fs)
            _refuse(checksums.count_problem(self._names[index], meta.num_rows, shard["tokens"]))
            for group in range(meta.num_row_groups):
                groups.append((index, group))
                starts.append(starts[-1] + meta.row_group(group).num_rows)
        self._groups = np.array(groups, dtype=np.int64).reshape(-1, 2)  # (shard, row group) per global group
        self._starts = np.array(starts, dtype=np.int64)
        _refuse(checksums.count_problem(f"the shards of {root}", int(self._starts[-1]), manifest["total_tokens"],
                                        "its manifest.json total_tokens"))

    def column_view(self, column: str) -> ShardStore:
        """The same shards read for ``column`` (checked once already), with caches of its own."""
        view = copy.copy(self)
        view.column, view._files, view._cache, view._lock = column, OrderedDict(), OrderedDict(), threading.Lock()
        return view

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def _open(self, index: int) -> pq.ParquetFile:
        if index in self._files:
            self._files.move_to_end(index)
        else:
            # buffered reads (no mapped pages pile up in RSS); on object storage, range requests
            source, fs = parquet_source(self._names[index])
            self._files[index] = pq.ParquetFile(source, filesystem=fs)
            if len(self._files) > self._limits["files"]:
                self._files.popitem(last=False)[1].close()
        return self._files[index]

    def _group(self, g: int) -> np.ndarray:
        with self._lock:
            if g in self._cache:
                self._cache.move_to_end(g)
                return self._cache[g]
            tokens = self._cache[g] = self.decode(g)
            if len(self._cache) > self._limits["cache"]:
                self._cache.popitem(last=False)
            return tokens

    def decode(self, g: int) -> np.ndarray:
        """Global row group ``g``'s tokens, decoded from its shard (not cached)."""
        shard, group = (int(v) for v in self._groups[g])
        column = self._open(shard).read_row_group(group, columns=[self.column]).column(0)
        return np.array(column)  # a numpy copy: the Arrow buffers go back to their pool at once

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream, across row-group and shard boundaries."""
        _check_range(start, length, len(self))
        g = int(np.searchsorted(self._starts, start, side="right")) - 1
        parts, pos = [], start
        while pos < start + length:
            take = min(start + length, int(self._starts[g + 1])) - pos
            lo = pos - int(self._starts[g])
            parts.append(self._group(g)[lo:lo + take])
            pos, g = pos + take, g + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int64 [len(starts), length]: row i is tokens [starts[i], starts[i] + length)."""
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, start in zip(out, starts.tolist()):
            row[:] = self.read(start, length)
        return out


class RawTokens:
    """A local corpus's whole token stream in one raw file (little-endian ids, no header).

    Why: the sample order is a permutation of the whole corpus, so consecutive windows land in unrelated row groups
    and a bounded cache of decoded groups misses almost always (a group decode per window was hundreds of times
    slower than the old in-memory loader). Decoded once into a file, a window needs no decode, no lock and no
    Arrow buffers, and the file's pages are the OS page cache, shared by every rank on the host. A file up to
    `MAP_LIMIT` is memory-mapped, so a batch is one numpy gather (a rank maps at most `MAP_LIMIT`); a larger one
    is read with one ``preadv`` per window into the batch, mapping nothing, so RSS does not grow as windows are
    read. Its bytes are checked against block digests written with it at every open (``raw_checksums``). The
    file is named by the shards' checksums, so a re-prepared corpus gets a new one, and it is built
    once per host under a file lock (written to a temporary name, then renamed) by whichever rank comes first;
    the others, and later runs, only open it.
    """

    def __init__(self, path: Path, dtype: np.dtype, tokens: int) -> None:
        self.path, self.dtype = path, np.dtype(dtype).newbyteorder("<")
        self._tokens = tokens
        size = path.stat().st_size
        if size != tokens * self.dtype.itemsize:
            raise ValueError(f"raw token file {path} has {size} bytes, expected {tokens * self.dtype.itemsize}; "
                             f"fix: delete {path.parent} and the loader rebuilds it from the shards")
        self._fd = os.open(path, os.O_RDONLY)
        self._mapped: np.ndarray | None = None
        if size <= MAP_LIMIT:
            self._mapped = np.frombuffer(mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ), self.dtype)
        weakref.finalize(self, os.close, self._fd)  # the map holds its own descriptor
        self.may_block = self._mapped is None  # preads may wait on the disk; a mapped gather is memory-speed

    @classmethod
    def build(cls, path: Path, groups: ShardStore, dtype: np.dtype) -> RawTokens:
        """The raw file of ``groups``' stream at ``path`` (decoded now unless another rank or run has), opened.

        One already there is checked against the block digests written with it (``raw_checksums``) and opened
        without the lock: it only ever appears whole, by rename, so a folder this user may read but not write
        (where another user's run built it) still serves it. One that fails them (changed bytes, cut short, no
        digests) is built again, with a warning naming it; in a folder this user cannot write, in the next one."""
        if path.exists():
            why = raw_checksums.problem(path)
            if why is None:
                return cls(path, dtype, len(groups))
            log.warning("raw token file %s %s; building it again from the shards", path, why)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not path.exists() or raw_checksums.problem(path) is not None:  # or another rank built it meanwhile
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                try:
                    with open(tmp, "wb") as out:
                        for g in range(groups.num_groups):  # one group in memory at a time
                            out.write(groups.decode(g).astype(np.dtype(dtype).newbyteorder("<"), copy=False).tobytes())
                    raw_checksums.write_sums(tmp, path)
                    tmp.replace(path)
                finally:
                    tmp.unlink(missing_ok=True)  # a failed build (disk full) leaves nothing behind
                key = path.name.split(".")[0]  # a corpus's raw files (tokens, loss mask) share it
                for stale in path.parent.iterdir():  # the raw files of shards re-prepared since
                    if not stale.name.startswith(key):
                        stale.unlink(missing_ok=True)  # (a run still reading one keeps its open copy)
        return cls(path, dtype, len(groups))

    def __len__(self) -> int:
        return self._tokens

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream."""
        return self.windows(np.array([start]), length)[0]

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """[len(starts), length] in the file's dtype: row i is tokens [starts[i], starts[i] + length). From a
        mapped file one gather; else each row one ``preadv`` straight into the result."""
        if len(starts):
            _check_range(int(starts.min()), length, len(self))
            _check_range(int(starts.max()), length, len(self))
        if self._mapped is not None:
            return self._mapped[starts[:, None] + np.arange(length)]
        out = np.empty((len(starts), length), dtype=self.dtype)
        size = self.dtype.itemsize
        done = sum(os.preadv(self._fd, [row], start) for row, start in zip(out, (starts * size).tolist()))
        if done != out.nbytes:
            raise ValueError(f"raw token file {self.path} was cut short while open; fix: delete {self.path.parent} "
                             "and start again (the loader rebuilds it from the shards)")
        return out


def open_stores(root: Path, manifest: dict) -> tuple[ShardStore | RawTokens, ShardStore | RawTokens | None]:
    """(tokens, loss-mask flags or None) of ``root``, each by `open_store`; the shards are checked once."""
    groups = ShardStore(root, manifest)  # checks every shard's checksum and footer first, either way
    flags = open_store(root, manifest, groups.column_view(LOSS_MASK)) if manifest.get(LOSS_MASK) else None
    return open_store(root, manifest, groups), flags


def open_store(root: Path, manifest: dict, groups: ShardStore) -> ShardStore | RawTokens:
    """The fastest reader of ``groups``' column ``root`` allows: `RawTokens` for a local directory whose manifest
    carries checksums and dtype (what names the raw file; the loss mask's, uint8, is named after the tokens' with
    its column), built beside the shards or in the user's cache (`raw_folders`), else the row-group `ShardStore`
    (object storage, directories prepared before checksums, or neither folder writable)."""
    digests = [shard.get(checksums.FIELD) for shard in manifest["shards"]]
    if is_url(root) or None in digests or "dtype" not in manifest:
        return groups
    key = hashlib.sha256(json.dumps([manifest["dtype"], digests]).encode()).hexdigest()[:32]
    dtype = manifest["dtype"] if groups.column == "tokens" else "uint8"
    name = f"{key}.{dtype}" if groups.column == "tokens" else f"{key}.{groups.column}.{dtype}"
    failures = []
    for folder in raw_folders(root):
        try:
            return RawTokens.build(folder / name, groups, np.dtype(dtype))
        except OSError as err:  # read-only or full: the next folder, at last the row groups (correct, much slower)
            failures.append(f"{folder / name} ({err})")
    log.warning("data loader cannot write %s; reading row groups instead, much slower; fix: make %s writable, or "
                "set XDG_CACHE_HOME to a writable directory", " nor ".join(failures), root)
    return groups


def raw_folders(root: Path) -> tuple[Path, Path]:
    """Where the raw file of the prepared directory ``root`` may go, in order: beside the shards (deleted with them,
    shared by every user's runs), else, for a directory this user cannot write (shared read-only storage), the
    user's cache, in a folder of its own per directory: the raw file in it is still named by the shards' checksums,
    and a re-prepared directory's old one is dropped there as beside the shards (`RawTokens.build`)."""
    resolved = root.resolve()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    per_dir = f"{resolved.name[:64]}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:16]}"
    return root / RAW_DIR, cache / CACHE_DIR / per_dir


def corpus_fingerprint(manifest: dict) -> str:
    """A short digest of a prepared corpus's content (its shards' checksums and token counts, in order), which a
    data position is only meaningful against: prepared again from other sources, the same position is another
    sample of another order."""
    shards = [[shard.get(checksums.FIELD), shard["tokens"]] for shard in manifest["shards"]]
    return hashlib.sha256(json.dumps(shards).encode()).hexdigest()[:16]


_WARNED: set[str] = set()  # the manifests warn_unchecked has named in this process


def warn_unchecked(manifest_path, manifest: dict) -> bool:
    """Warn, once per process for each manifest, that its shards carry no checksums (prepared before them, or the
    fields deleted): nothing then tells changed or cut shards from the ones prepared. Returns whether it warned."""
    if not checksums.unchecked(manifest) or str(manifest_path) in _WARNED:
        return False
    _WARNED.add(str(manifest_path))
    log.warning("%s lists shards without a %s checksum: their bytes are read unchecked (and row group by row group, "
                "slower); fix: run `raymesh prepare-data` again for this directory", manifest_path, checksums.FIELD)
    return True


class TokenDataset:
    """Non-overlapping `seq_len + 1` windows (sharing one boundary token) over the token stream."""

    def __init__(self, path: str | Path, seq_len: int, seed: int) -> None:
        self.path = location(path)  # a directory, or an s3:// / gs:// prefix
        manifest_path = self.path / "manifest.json"
        if not manifest_path.is_file():
            raise FileNotFoundError(f"no prepared data at {manifest_path}; {_MISSING_HINT}")
        manifest = json.loads(manifest_path.read_text())
        problem = manifest_problem(manifest)
        if problem is not None:
            raise ValueError(f"{manifest_path} cannot be read: {problem}; fix: {checksums.REPREPARE}")
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{manifest_path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.seq_len = seq_len
        self.seed = seed
        self.vocab_size: int = manifest["vocab_size"]
        self.eos_id: int | None = manifest_eos_id(manifest)  # between documents; None for bare rows of ids
        self.corpus = corpus_fingerprint(manifest)
        warn_unchecked(manifest_path, manifest)
        self.store, self.flags = open_stores(self.path, manifest)  # flags: the loss mask, or None
        self.pairs = _preference_pairs(manifest, seq_len, self.path)
        self._num_samples = (len(self.store) - 1) // seq_len
        if self._num_samples == 0:
            raise ValueError(
                f"seq_len={seq_len} needs at least {seq_len + 1} tokens but {self.path} "
                f"has {len(self.store)}; lower seq_len or prepare more data"
            )
        self._epoch_order = lru_cache(maxsize=2)(self._compute_epoch_order)

    @property
    def num_samples(self) -> int:
        return self._num_samples

    @property
    def may_block(self) -> bool:
        """Whether a batch may wait on I/O (then `Prefetch` reads the next one ahead)."""
        return self.store.may_block

    def _compute_epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's sample order, kept as the narrowest index type (4 bytes a sample below 2**31 samples). For
        preference data the pairs are shuffled, each kept as its two sequences in a row (chosen, rejected)."""
        rng = np.random.default_rng([self.seed, epoch])
        if self.pairs:
            pairs = rng.permutation(self._num_samples // 2)
            order = np.stack([2 * pairs, 2 * pairs + 1], axis=1).ravel()
        else:
            order = rng.permutation(self._num_samples)
        return order.astype(np.int32) if self._num_samples < 2**31 else order

    def global_sample_ids(self, start: int, count: int) -> np.ndarray:
        """Sample ids at positions [start, start+count) of the stream epoch0, epoch1, ..."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be non-negative, got {start}, {count}")
        epoch, first = divmod(start, self._num_samples)
        if first + count <= self._num_samples:  # within one epoch (all but one step an epoch): a slice
            return self._epoch_order(epoch)[first:first + count].astype(np.int64)
        positions = np.arange(start, start + count, dtype=np.int64)
        epochs, index = np.divmod(positions, self._num_samples)
        ids = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            ids[mask] = self._epoch_order(int(epoch))[index[mask]]
        return ids

    @property
    def loss_mask(self) -> bool:
        """Whether targets may be `IGNORE_INDEX` (data of ``prepare-data --format prompt-completion``)."""
        return self.flags is not None

    def read(self, sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The samples' `seq_len + 1` windows, and their loss-mask flags (None for data without)."""
        starts, length = sample_ids * self.seq_len, self.seq_len + 1
        return self.store.windows(starts, length), None if self.flags is None else self.flags.windows(starts, length)

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [count, seq_len], for stream positions [start, start+count)."""
        return inputs_targets(*self.read(self.global_sample_ids(start, count)))


def _preference_pairs(manifest: dict, seq_len: int, path) -> bool:
    """Whether the data holds preference pairs (``prepare-data --format preference``), whose sequences were padded
    to the ``seq_len`` its manifest records: at another length windows would straddle sequences and pairs."""
    pairs = manifest.get(PREFERENCE)
    if pairs and pairs["seq_len"] != seq_len:
        raise ValueError(f"model.seq_len {seq_len} does not match the {pairs['seq_len']} tokens every preference "
                         f"sequence in {path} was padded to; fix: set model.seq_len: {pairs['seq_len']}, or prepare "
                         f"the pairs again with --seq-len {seq_len}")
    return bool(pairs)


def inputs_targets(windows: np.ndarray, flags: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of token ``windows``; with loss-mask ``flags`` a target whose token is not flagged (a
    prompt token) is `IGNORE_INDEX`: so a window's last prompt token still predicts the first completion token."""
    tokens = torch.from_numpy(windows.astype(np.int64, copy=False))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if flags is None:
        return inputs, targets
    return inputs, targets.masked_fill(torch.from_numpy(flags[:, 1:] == 0), IGNORE_INDEX)


class MixedDataset:
    """A weighted mixture of prepared directories (`data.mix`), read as one stream.

    Position ``i`` comes from the source `workers.data.blend` picks for it and is that source's next sample in its
    own order (its epochs permuted by [seed, epoch], as a `TokenDataset` alone): a small source repeats while a
    large one does not, and the order, like a single directory's, depends on the position alone, so ranks take
    contiguous slices and a checkpoint's `position` resumes it at any dp size.
    """

    def __init__(self, sources: list[tuple[str, float]], seq_len: int, seed: int) -> None:
        self.sources = [TokenDataset(path, seq_len, seed) for path, _ in sources]
        self.shares = blend.normalised([weight for _, weight in sources])
        self.seq_len, self.seed = seq_len, seed
        self.vocab_size = max(source.vocab_size for source in self.sources)
        self.eos_id = self.sources[0].eos_id  # one tokenizer's ids: the spec checks every source's against the first
        self.path = " + ".join(str(source.path) for source in self.sources)  # as messages name the data
        # the position counts samples of this order: the sources' contents and their weights
        self.corpus = hashlib.sha256(json.dumps([[s.corpus for s in self.sources], self.shares.tolist()])
                                     .encode()).hexdigest()[:16]

    @property
    def may_block(self) -> bool:
        return any(source.may_block for source in self.sources)

    @property
    def loss_mask(self) -> bool:
        """Whether any source carries a loss mask; every target of a source without one counts."""
        return any(source.loss_mask for source in self.sources)

    def contributed(self, position: int) -> dict[str, int]:
        """How many of the first ``position`` samples each source supplied, by its path (the run's records)."""
        return {str(source.path): int(n) for source, n in zip(self.sources, blend.counts(self.shares, position))}

    def global_sample_ids(self, start: int, count: int) -> np.ndarray:
        """int64 [count, 2]: (source, sample id within it) at positions [start, start+count)."""
        which, index = blend.take(self.shares, start, count)
        ids = np.empty_like(index)
        for j, source in enumerate(self.sources):
            mine = which == j
            if mine.any():  # a source's positions in this slice are consecutive in its own stream
                ids[mine] = source.global_sample_ids(int(index[mine][0]), int(mine.sum()))
        return np.stack([which, ids], axis=1)

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [count, seq_len], for stream positions [start, start+count)."""
        pairs = self.global_sample_ids(start, count)
        windows = np.empty((count, self.seq_len + 1), dtype=np.int64)
        flags = np.ones_like(windows, dtype=np.uint8) if self.loss_mask else None
        for j, source in enumerate(self.sources):
            mine = pairs[:, 0] == j
            if mine.any():
                windows[mine], theirs = source.read(pairs[mine, 1])
                if theirs is not None:
                    flags[mine] = theirs
        return inputs_targets(windows, flags)


def open_data(path: str | None, mix: list[tuple[str, float]] | None, seq_len: int,
              seed: int) -> TokenDataset | MixedDataset:
    """The job's training stream: one prepared directory (`data.path`) or a weighted mixture (`data.mix`)."""
    return MixedDataset(mix, seq_len, seed) if mix else TokenDataset(path, seq_len, seed)


class Prefetch:
    """The next step's batch, read on a background thread while this step trains.

    A cursor's next start is known once a step is taken, so the read (row-group decodes, object-store range
    requests) overlaps the step. A batch is used only when asked for the same (start, count): a checkpoint load
    or a resize that moves the position just reads synchronously, so the order never depends on timing. Where
    the store never waits on I/O (a memory-mapped raw file: a batch is one gather) nothing is read ahead: handing
    a batch between threads would cost more than reading it.
    """

    def __init__(self, dataset: TokenDataset | MixedDataset) -> None:
        self.dataset = dataset
        self._pending: tuple[tuple[int, int], Future] | None = None
        self._pool: ThreadPoolExecutor | None = None

    def ahead(self, start: int, count: int) -> None:
        if not self.dataset.may_block:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raymesh-prefetch")
        self._pending = ((start, count), self._pool.submit(self.dataset.batch, start, count))

    def take(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == (start, count):
            return pending[1].result()
        return self.dataset.batch(start, count)


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Each token's document in its window ``tokens`` [batch, seq]: the running count of ``eos_id``, which
    opens the next document (the token before it still learns to predict it): ``workers.model.documents``."""
    return (tokens == eos_id).cumsum(-1)


def document_eos(attention_mask: str, dataset: TokenDataset | MixedDataset) -> int | None:
    """The id ``DataCursor`` counts documents by: the data's end-of-document id under ``model.attention_mask:
    document``, else None (no document ids kept). Data without one is refused before start too
    (``orchestrator.spec.runtime_checks``); here for a rank handed such data anyway."""
    if attention_mask != "document":
        return None
    if dataset.eos_id is None:
        raise ValueError(f"model.attention_mask: document needs the end-of-document id of the data in "
                         f"{dataset.path}, whose manifest records none (ids written as bare rows); fix: prepare it "
                         "with `raymesh prepare-data`, or set model.attention_mask: causal")
    return dataset.eos_id


class DataCursor:
    """One data-parallel rank's view: each step consumes `global_batch` stream positions.

    Under context parallelism (`cp_size` > 1) the rank keeps only its cp share of each sequence, inputs and
    targets alike (`workers.parallel.context_layout.split_sequence`); the position still counts whole samples,
    so a checkpoint resumes at any cp degree. With `eos_id` (document masking) `documents` holds the last
    batch's document ids over the whole windows, before the cp split: a cp rank's attention needs every key's.
    """

    def __init__(
        self, dataset: TokenDataset | MixedDataset, global_batch: int, dp_rank: int, dp_size: int, position: int = 0,
        cp_rank: int = 0, cp_size: int = 1, eos_id: int | None = None,
    ) -> None:
        if global_batch <= 0 or dp_size <= 0 or global_batch % dp_size:
            raise ValueError(
                f"global_batch={global_batch} must be a positive multiple of dp_size={dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} out of range for dp_size={dp_size}")
        if position < 0:
            raise ValueError(f"position must be non-negative, got {position}")
        self.dataset = dataset
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.position = position
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.eos_id = eos_id
        self.documents: torch.Tensor | None = None
        self._prefetch = Prefetch(dataset)

    @property
    def start(self) -> int:
        """Stream position of this rank's first sample in the next step."""
        return self._start

    @property
    def _start(self) -> int:
        return self.position + self.dp_rank * (self.global_batch // self.dp_size)

    def sample_ids_for_step(self) -> np.ndarray:
        """Ids this rank's next `next_batch` will return (for auditing coverage)."""
        return self.dataset.global_sample_ids(self._start, self.global_batch // self.dp_size)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        per_rank = self.global_batch // self.dp_size
        inputs, targets = self._prefetch.take(self._start, per_rank)
        self.position += self.global_batch
        self._prefetch.ahead(self._start, per_rank)
        self.documents = None if self.eos_id is None else document_ids(inputs, self.eos_id)
        return (split_sequence(inputs, self.cp_size, self.cp_rank),
                split_sequence(targets, self.cp_size, self.cp_rank))

    def state_dict(self) -> dict:
        return {
            "position": self.position,
            "seed": self.dataset.seed,
            "seq_len": self.dataset.seq_len,
            "global_batch": self.global_batch,
            "corpus": self.dataset.corpus,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore position; global_batch may differ (position counts samples, not steps). A position saved over
        another corpus is refused (checkpoints from before the fingerprint carry none and are taken as they are)."""
        for key in ("seed", "seq_len"):
            mine = getattr(self.dataset, key)
            if state[key] != mine:
                field = "data.seed" if key == "seed" else "model.seq_len"
                raise ValueError(f"data checkpoint {key}={state[key]} does not match dataset {key}={mine}: the "
                                 f"saved position counts samples of another order; fix: set {field}: {state[key]} "
                                 "as the run that saved it had, or start a new run_dir")
        if state.get("corpus", self.dataset.corpus) != self.dataset.corpus:
            raise ValueError(
                f"the checkpoint's data position counts samples of another corpus (fingerprint {state['corpus']}) "
                f"than {self.dataset.path} holds now ({self.dataset.corpus}): it was prepared again, or data.path "
                "or data.mix (a path or a weight) changed, and the position would resume in another order, "
                "repeating and skipping samples; fix: point data.path or data.mix at the corpus and weights the run "
                "trained on, or start a new run_dir for the new data")
        if state["position"] < 0:
            raise ValueError(f"checkpoint position must be non-negative, got {state['position']}")
        self.position = int(state["position"])
