"""A checksum per token shard, recorded in the data manifest by ``prepare_data`` and checked on load.

Parquet checks its pages' structure, not that the bytes are the ones written: a shard truncated by a
full disk or changed by another job's prepare-data into the same directory would otherwise train on
silently different data (and a resumed run on different samples than it saved the position of).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

FIELD = "sha256"
_CHUNK = 1 << 20


def file_digest(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks (a token shard, a pinned base's weights)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:  # a Path or an object-store UPath (workers.storage)
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_shard(root: Path, entry: dict) -> None:
    """Raise ``ValueError`` naming the shard when its bytes differ from the manifest's checksum (manifests from
    before checksums have none, and load as before)."""
    expected = entry.get(FIELD)
    if expected is None:
        return
    path = root / entry["file"]
    if file_digest(path) != expected:
        raise ValueError(f"data shard {path} fails its {FIELD} check against {root / 'manifest.json'} (changed or "
                         "truncated since it was prepared); fix: run `raymesh prepare-data` again for this directory")
