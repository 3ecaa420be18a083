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

What is written as many small appends (a run dir's step records, TensorBoard event files) or by a library
that wants a local path (Parquet shards, safetensors) is written to a local directory first and copied up as
whole objects (`staging_dir`, `upload_tree`, `staged_output`): an object store has no append, and a half-written
object is never visible.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
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


def staging_dir(url: str) -> Path:
    """The local directory whose files are copied up to the object-store directory ``url``: one per URL, in
    the temp directory, so every process on a machine (driver, controller) finds the same one."""
    name = url.rstrip("/").rsplit("/", 1)[-1] or "run"
    return Path(tempfile.gettempdir()) / "raymesh-staging" / f"{name}-{hashlib.sha1(url.encode()).hexdigest()[:8]}"


def upload_tree(local: Path, dest: Path, skip: Iterable[str] = (), last: Iterable[str] = (),
                sent: dict[str, tuple[int, int]] | None = None) -> list[str]:
    """Copy every file under ``local`` to the object-store directory ``dest`` (one PUT each, whole files);
    returns the relative names copied. ``skip``: names never copied (secrets). ``last``: names copied after the
    others, so a manifest never names an object that is not there yet. ``sent``: (size, mtime) of what an
    earlier call copied, updated here; a file unchanged since is not copied again."""
    skip, last = set(skip), list(last)
    files = sorted(str(f.relative_to(local)) for f in local.rglob("*") if f.is_file())
    files = [f for f in files if f not in skip and f not in last] + [f for f in last if f in files]
    copied = []
    for name in files:
        stat = (local / name).stat()
        if sent is not None and sent.get(name) == (stat.st_size, stat.st_mtime_ns):
            continue
        dest.fs.put_file(str(local / name), f"{dest.path}/{name}")
        copied.append(name)
        if sent is not None:
            sent[name] = (stat.st_size, stat.st_mtime_ns)
    return copied


def download_tree(src: Path, local: Path, skip_dirs: Iterable[str] = ()) -> list[str]:
    """Copy every object under the object-store directory ``src`` into ``local`` (overwriting), except those
    under the top-level folders ``skip_dirs``; returns the relative names copied."""
    skip_dirs = set(skip_dirs)
    copied = []
    for key in src.fs.find(src.path):
        name = key[len(src.path):].lstrip("/")
        if not name or name.split("/", 1)[0] in skip_dirs:
            continue
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        src.fs.get_file(key, str(local / name))
        copied.append(name)
    return copied


@contextmanager
def staged_output(out: str | Path, last: Iterable[str] = ()) -> Iterator[Path]:
    """A directory to write an output into: ``out`` itself when local, else a fresh temporary one whose files
    are copied to the URL ``out`` once the block succeeds (``last`` as in `upload_tree`); a failed block
    copies nothing."""
    if not is_url(out):
        yield location(out)
        return
    with tempfile.TemporaryDirectory(prefix="raymesh-out-") as tmp:
        yield Path(tmp)
        upload_tree(Path(tmp), location(out), last=last)
