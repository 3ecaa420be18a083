"""A checksum per token shard, recorded in the data manifest by ``prepare_data`` and checked on load.

Parquet checks its pages' structure, not that the bytes are the ones written: a shard truncated by a
full disk or changed by another job's prepare-data into the same directory would otherwise train on
silently different data (and a resumed run on different samples than it saved the position of).
The same checks run on the driver before any actor starts (``orchestrator.spec.integrity_checks``) and in each
rank as it opens the data (``workers.data.loader``), so their wording is here, once.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

FIELD = "sha256"
_CHUNK = 1 << 20
REPREPARE = "run `raymesh prepare-data` again for this directory"


def file_digest(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks (a token shard, a pinned base's weights)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:  # a Path or an object-store UPath (workers.storage)
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def unchecked(manifest: dict) -> bool:
    """Whether any shard of ``manifest`` has no checksum (prepared before checksums, or the fields deleted): its
    bytes cannot be checked, and the loader reads it without the raw token file."""
    return any(shard.get(FIELD) is None for shard in manifest["shards"])


def shard_problem(root: Path, entry: dict) -> str | None:
    """What is wrong with the shard ``entry`` names under ``root`` against its checksum (None: nothing, or no
    checksum to compare)."""
    expected = entry.get(FIELD)
    if expected is None:
        return None
    path = root / entry["file"]
    if file_digest(path) != expected:
        return (f"data shard {path} fails its {FIELD} check against {root / 'manifest.json'} (changed or truncated "
                "since it was prepared)")
    return None


def count_problem(path, rows: int, listed: int, what: str = "its entry in manifest.json") -> str | None:
    """A shard (or a directory's shards, ``what``: the manifest's total) holding another number of tokens than
    the manifest says."""
    if rows == listed:
        return None
    return f"{path} holds {rows:,} tokens, {what} says {listed:,}"


def verify_shard(root: Path, entry: dict) -> None:
    """Raise ``ValueError`` naming the shard when its bytes differ from the manifest's checksum (manifests from
    before checksums have none, and load as before)."""
    problem = shard_problem(root, entry)
    if problem is not None:
        raise ValueError(f"{problem}; fix: {REPREPARE}")
