"""Per-block SHA-256 of a raw token file (``workers.data.loader.RawTokens``): written when it is built, checked
each time it is opened.

The raw file is what every rank on a host trains from, for every run over that corpus, and nothing but its size
was checked: a changed byte in it trained other losses without a word, the shards' own checksums untouched. Its
name carries the shards' checksums, so a block digest here says the file still holds the tokens those shards
decode to. Blocks (not one digest) so a refusal names where the file changed; SHA-256 because it is the one the
shards use and ``hashlib`` runs it at over 1 GB/s here (20M uint16 tokens, 40 MB, in about 25 ms).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

BLOCK = 4 << 20
_READ = 64 << 10  # bytes read at a time
SUFFIX = ".sha256"


def sums_path(raw: Path) -> Path:
    """Where the digests of the raw file ``raw`` are kept: beside it, named after it."""
    return raw.with_name(raw.name + SUFFIX)


def block_digests(path: Path, block: int = BLOCK) -> list[str]:
    """Hex SHA-256 of each ``block`` bytes of ``path`` (the last one shorter), read through one small buffer, so
    checking a file costs no memory that grows with it (a rank's loader must stay flat in the corpus size)."""
    out, view = [], memoryview(bytearray(_READ))
    digest, filled = hashlib.sha256(), 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view[:min(_READ, block - filled)]):
            digest.update(view[:n])
            filled += n
            if filled == block:
                out.append(digest.hexdigest())
                digest, filled = hashlib.sha256(), 0
    if filled:
        out.append(digest.hexdigest())
    return out


def write_sums(built: Path, raw: Path) -> Path:
    """Record the digests of ``built`` (a raw file just written, under a temporary name) as those of ``raw``, the
    name it is renamed to next: all or nothing (temp file, rename), before the raw file appears, so a raw file
    in place always has its digests."""
    record = {"block_bytes": BLOCK, "bytes": built.stat().st_size, "sha256": block_digests(built)}
    target = sums_path(raw)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(target)
    return target


def problem(raw: Path) -> str | None:
    """What is wrong with the raw file ``raw`` against its digests (None: it holds what was built)."""
    sums = sums_path(raw)
    try:
        record = json.loads(sums.read_text())
        block, size, expected = int(record["block_bytes"]), int(record["bytes"]), list(record["sha256"])
    except FileNotFoundError:
        return f"has no checksums ({sums.name} is missing: built by an older raymesh)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"has unreadable checksums ({sums}: {exc})"
    actual = raw.stat().st_size
    if actual != size:
        return f"has {actual} bytes, {sums.name} recorded {size}"
    digests = block_digests(raw, block)
    bad = next((i for i, (got, want) in enumerate(zip(digests, expected, strict=False)) if got != want), None)
    if bad is None and len(digests) == len(expected):
        return None
    bad = len(expected) if bad is None else bad
    return (f"changed since it was built: bytes [{bad * block}, {min((bad + 1) * block, actual)}) fail their sha256 "
            f"check against {sums.name}")
