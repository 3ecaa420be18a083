"""Per-file checksums for DCP checkpoints: a manifest written once a save is durable, checked before a load.

DCP marks a save complete with its ``.metadata`` file but never checks the
bytes it reads back, so a flipped bit or a truncated shard would load as
silently wrong weights. The manifest (``MANIFEST``: size and CRC-32 of every
file) is written after the save completes, atomically (temp file + rename),
so its presence also means "complete"; ``problem`` names the first file that
no longer matches. Written here because neither PyTorch nor Ray checksums
checkpoint files. Paths may be object-store locations (`workers.storage`): there a manifest
is one PUT, which an object store makes visible all at once, so the temp file, rename and fsyncs are local only.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from workers.storage import is_url, location

MANIFEST = "raymesh-manifest.json"
_CHUNK = 1 << 20


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"))


def _entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "crc32": _crc32(path)}


def write_json(path: Path, data: dict) -> Path:
    """``data`` as JSON at ``path``, all or nothing (the rename) and durably (the fsyncs: the file, the rename in
    its directory, and that directory's own entry), so a power loss cannot leave a sealed-looking save without its
    manifest, nor a half-written file a resume reads; on an object store, one PUT."""
    if is_url(path):
        path.write_text(json.dumps(data, indent=1))
        return path
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    fsync_dir(path.parent.parent)
    return path


def _write(manifest: Path, files: dict) -> Path:
    return write_json(manifest, {"files": files})


def write_manifest(ckpt: str | Path) -> Path:
    """Record size and CRC-32 of every file of a completed save."""
    ckpt = location(ckpt)
    return _write(ckpt / MANIFEST, {p.relative_to(ckpt).as_posix(): _entry(p) for p in _files(ckpt)})


def sidecar(path: str | Path) -> Path:
    """The manifest of a single-file checkpoint (an `export-merged` .pt): `<file>.raymesh-manifest.json`."""
    path = Path(path)
    return path.with_name(f"{path.name}.{MANIFEST}")


def write_file_manifest(path: str | Path) -> Path:
    """Record size and CRC-32 of one finished file beside it."""
    path = Path(path)
    return _write(sidecar(path), {path.name: _entry(path)})


def file_problem(path: str | Path) -> str | None:
    """Why the single-file checkpoint at ``path`` must not be loaded; None when it matches its sidecar manifest
    (or has none: a .pt raymesh did not write, which only loading can judge)."""
    path = Path(path)
    try:
        files = json.loads(sidecar(path).read_text())["files"]
    except FileNotFoundError:
        return None
    except (ValueError, KeyError):
        return f"{sidecar(path).name} is not readable"
    return _mismatch(path.parent, files)


def _mismatch(root: Path, files: dict) -> str | None:
    """The first file under ``root`` that no longer matches its manifest entry."""
    for name, expected in files.items():
        path = root / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['bytes']}"
        if _crc32(path) != expected["crc32"]:
            return f"{name} fails its CRC-32 check"
    return None


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (renames, new files) durable: fsync on the directory itself."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def problem(ckpt: str | Path) -> str | None:
    """Why the checkpoint at ``ckpt`` must not be loaded, or None when every file matches its manifest."""
    ckpt = location(ckpt)
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (the save did not complete)"
    except (ValueError, KeyError):
        return f"{MANIFEST} is not readable"
    if ".metadata" not in files:
        return "the manifest lists no .metadata (the save did not complete)"
    return _mismatch(ckpt, files)
