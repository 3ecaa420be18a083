"""Where checkpoints and token shards live: a local path, or an object-store URL (``s3://``, ``gs://``) via fsspec.

`location` gives both the same pathlib face (``/``, ``iterdir``, ``is_dir``, ``open``, ``stat``, ``rglob``):
a local path stays a ``pathlib.Path`` (``file://`` URLs become one), a URL becomes a ``upath.UPath`` over the
fsspec file system of its scheme (``s3fs`` for ``s3://``, ``gcsfs`` for ``gs://``), so `CheckpointDir`, the
checksum manifests and the data loader have one code path. Listings are never cached: ranks write the objects
from other processes, so a cached listing would hide a save or show a removed one. Credentials come from the
scheme's usual places (for S3: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``~/.aws``,
an instance role), on every node: each rank reads and writes its own shards.
DCP itself writes and reads URLs with its ``FsspecWriter``/``FsspecReader``, which it picks for a
``checkpoint_id`` that is one.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from urllib.parse import urlparse


def is_url(path: str | Path) -> bool:
    """Whether ``path`` names an fsspec location other than the local file system."""
    return "://" in str(path) and not str(path).startswith("file://")


def location(path: str | Path) -> Path:
    """``path`` as a ``Path`` (local, ``file://`` included) or a ``UPath`` (any other URL)."""
    text = str(path)
    if text.startswith("file://"):
        return Path(urlparse(text).path)
    if not is_url(text):
        return Path(text)
    from upath import UPath  # only jobs that use object storage need it (and its scheme's fsspec package)

    return UPath(text, use_listings_cache=False)


def remove_tree(path: Path) -> None:
    """Delete the directory (or prefix) ``path`` and everything under it; nothing there is fine."""
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.fs.rm(path.path, recursive=True)


def move_tree(src: Path, dst: Path) -> None:
    """Rename the directory ``src`` to ``dst``. An object store has no rename: each object is copied, then the
    originals deleted (fsspec's recursive ``mv`` also tries to copy the prefix itself as a key, which fails)."""
    if not is_url(src):
        src.rename(dst)
        return
    for key in src.fs.find(src.path):
        src.fs.copy(key, dst.path + key[len(src.path):])
    remove_tree(src)


def parquet_source(path: Path) -> tuple[str | Path, object | None]:
    """(source, filesystem) for pyarrow's Parquet readers: for a URL its fsspec file system (pyarrow wraps it),
    so a read fetches only the byte ranges it needs."""
    return (path.path, path.fs) if is_url(path) else (path, None)
