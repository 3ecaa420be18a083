"""Per-file checksums for DCP checkpoints: a manifest written once a save is durable, checked before a load.

DCP marks a save complete with its ``.metadata`` file but never checks the
bytes it reads back, so a flipped bit or a truncated shard would load as
silently wrong weights. The manifest (``MANIFEST``: size and CRC-32 of every
file) is written after the save completes, atomically (temp file + rename),
so its presence also means "complete"; ``problem`` names the first file that
no longer matches. Written here because neither PyTorch nor Ray checksums
checkpoint files.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

MANIFEST = "raymesh-manifest.json"
_CHUNK = 1 << 20


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"))


def write_manifest(ckpt: str | Path) -> Path:
    """Record size and CRC-32 of every file of a completed save; the rename makes it all-or-nothing."""
    ckpt = Path(ckpt)
    files = {str(p.relative_to(ckpt)): {"bytes": p.stat().st_size, "crc32": _crc32(p)} for p in _files(ckpt)}
    tmp = ckpt / f"{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps({"files": files}, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt / MANIFEST)
    fsync_dir(ckpt)  # the rename itself, so a power loss cannot leave a sealed-looking directory without it
    fsync_dir(ckpt.parent)  # and the checkpoint directory's own entry
    return ckpt / MANIFEST


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (renames, new files) durable: fsync on the directory itself."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def problem(ckpt: str | Path) -> str | None:
    """Why the checkpoint at ``ckpt`` must not be loaded, or None when every file matches its manifest."""
    ckpt = Path(ckpt)
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (the save did not complete)"
    except (ValueError, KeyError):
        return f"{MANIFEST} is not readable"
    if ".metadata" not in files:
        return "the manifest lists no .metadata (the save did not complete)"
    for name, expected in files.items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['bytes']}"
        if _crc32(path) != expected["crc32"]:
            return f"{name} fails its CRC-32 check"
    return None
