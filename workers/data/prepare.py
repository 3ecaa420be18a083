"""Turn source trees into byte-level token shards (vocab = 256) plus a manifest.

Bytes are used as tokens so no tokenizer has to be trained or downloaded; the
default corpus is the running interpreter's standard library, present everywhere.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from workers.data import checksums

FORMAT = "raymesh-bytes-v1"
VOCAB_SIZE = 256
SEPARATOR = 0  # byte placed between documents; NUL practically never occurs in text
ROW_GROUP_ROWS = 1_000_000
DEFAULT_EXTENSIONS = (".py", ".txt", ".md", ".rst")
# Third-party installs nested in a tree (e.g. the stdlib's site-packages) would make the
# corpus depend on what happens to be installed; a source that *is* such a dir still works.
PRUNED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def default_sources() -> list[Path]:
    """The stdlib source dir: a sizeable text corpus that needs no download."""
    return [Path(sysconfig.get_paths()["stdlib"])]


def _iter_files(source: Path, extensions: tuple[str, ...]) -> Iterator[Path]:
    """Matching files under `source` in sorted order; an explicitly named file is always included."""
    if source.is_file():
        yield source
        return
    for root, dirs, files in os.walk(source):  # does not follow dir symlinks: no cycles
        dirs[:] = sorted(d for d in dirs if d not in PRUNED_DIRS)
        for name in sorted(files):
            if name.endswith(extensions):
                yield Path(root, name)


def _iter_documents(sources: Iterable[Path], extensions: tuple[str, ...]) -> Iterator[bytes]:
    for source in sources:
        for path in _iter_files(source, extensions):
            try:
                data = path.read_bytes()
            except OSError:
                continue  # unreadable (permissions, broken link): skip rather than abort the corpus
            if data:
                yield data


def _write_shard(out: Path, index: int, buf: bytes) -> dict:
    name = f"shard-{index:05d}.parquet"
    table = pa.table({"tokens": pa.array(np.frombuffer(buf, dtype=np.uint8))})
    pq.write_table(table, out / name, row_group_size=ROW_GROUP_ROWS)
    return {"file": name, "tokens": len(buf), checksums.FIELD: checksums.shard_digest(out / name)}


def prepare_data(
    sources: list[str | Path],
    out: str | Path,
    shard_tokens: int = 4_000_000,
    extensions: Iterable[str] = DEFAULT_EXTENSIONS,
    max_tokens: int | None = None,
) -> dict:
    """Concatenate matching files (NUL-separated) into Parquet shards under `out`; return the manifest.

    Stops after `max_tokens` tokens (separators included) so the default corpus stays bounded.
    """
    if shard_tokens <= 0:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive or None, got {max_tokens}")
    paths = [Path(s).expanduser().resolve() for s in sources]
    for p in paths:
        if not p.exists():
            raise FileNotFoundError(
                f"data source {p} does not exist; pass an existing directory to --source"
            )
    exts = tuple(extensions)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("shard-*.parquet"):  # a previous, larger run must not leave orphans
        stale.unlink()

    shards: list[dict] = []
    buf = bytearray()
    total = 0
    limit = max_tokens if max_tokens is not None else float("inf")
    for doc in _iter_documents(paths, exts):
        piece = (bytes([SEPARATOR]) + doc) if total else doc
        piece = piece[: int(min(len(piece), limit - total))]
        buf += piece
        total += len(piece)
        while len(buf) >= shard_tokens:
            shards.append(_write_shard(out, len(shards), bytes(buf[:shard_tokens])))
            del buf[:shard_tokens]
        if total >= limit:
            break
    if buf:
        shards.append(_write_shard(out, len(shards), bytes(buf)))
    if total == 0:
        raise ValueError(
            f"no tokens found in sources {[str(p) for p in paths]} with extensions {list(exts)}"
        )

    manifest = {
        "format": FORMAT,
        "vocab_size": VOCAB_SIZE,
        "shards": shards,
        "total_tokens": total,
        "sources": [str(p) for p in paths],
    }
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(out / "manifest.json")  # atomic: readers never see a half-written manifest
    return manifest
