"""DCP loads that run no code a checkpoint file carries.

DCP unpickles a checkpoint's ``.metadata`` with plain ``pickle.load`` (``FileSystemReader.read_metadata``, torch
2.11 and 2.13 alike) and the non-tensor entries of its ``.distcp`` files (the step, the data position, the LR
schedule) with ``torch.load(weights_only=False)`` (``DefaultLoadPlanner.load_bytes``). A pickle placed in either
runs while the checkpoint loads, and the checksum manifest beside a save is no defence: anyone who can write the
file can write its CRC too. So every DCP load raymesh makes goes through ``dcp_load`` here:

* ``.metadata`` is read by a restricted unpickler (``METADATA_GLOBALS``): the records of
  ``torch.distributed.checkpoint.metadata`` (``Metadata``, ``TensorStorageMetadata``, ``BytesStorageMetadata``,
  ``ChunkStorageMetadata``, ``TensorProperties``, ``MetadataIndex``, ``StorageMeta`` and its memory-format enum),
  DCP's ``_StorageInfo``, ``torch.Size``, torch dtypes and layouts, ``pathlib`` paths, and ``set``/``frozenset``/
  ``OrderedDict``; anything else is refused before it is built (``UnsafeCheckpoint``), naming the file and the object.
* a non-tensor entry is unpickled with ``weights_only=True`` first (torch's own allowlist: numbers, strings, bytes,
  containers, tensors; and ``io.BytesIO``, which DCP pickles a BytesIO value as); only once that has passed does
  DCP's loader take it, so nothing outside that list is ever called.

This protects even a job whose run directory someone else can write, with no secret to keep.
"""

from __future__ import annotations

import io
import pickle
import re
from collections import OrderedDict
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

from workers.storage import is_url

METADATA_FILE = ".metadata"
NEVER_HELD = "an object a checkpoint never holds"
_PLAIN = {("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
          ("collections", "OrderedDict"): OrderedDict, ("torch", "Size"): torch.Size,
          ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
          ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
          **{("pathlib", cls.__name__): cls for cls in (Path, PosixPath, WindowsPath, PurePosixPath, PureWindowsPath)}}


def _metadata_record(module: str, name: str):
    """A class ``torch.distributed.checkpoint.metadata`` defines (its dataclasses and enum), else None."""
    if module != dcp_metadata.__name__:
        return None
    found = getattr(dcp_metadata, name, None)
    return found if isinstance(found, type) and found.__module__ == module else None


def _torch_constant(module: str, name: str):
    """``torch.<name>`` when it is a dtype or a layout (``torch.float32``, ``torch.strided``), else None."""
    found = getattr(torch, name, None) if module == "torch" else None
    return found if isinstance(found, (torch.dtype, torch.layout)) else None


def allowed_global(module: str, name: str):
    """What a DCP ``.metadata`` may name (``METADATA_GLOBALS`` in words), or None for anything else."""
    return _PLAIN.get((module, name)) or _metadata_record(module, name) or _torch_constant(module, name)


METADATA_GLOBALS = ("torch.distributed.checkpoint.metadata records, DCP's _StorageInfo, torch.Size, torch dtypes "
                    "and layouts, pathlib paths, set, frozenset, OrderedDict")


class CheckpointRefusal(ValueError):
    """A load refused with a one-line reason (``dcp_load`` raises it as itself, out of DCP's wrapping)."""


class UnsafeCheckpoint(CheckpointRefusal):
    """A checkpoint file holds what DCP would unpickle by running code, or is not a DCP file at all: the one-line
    refusal, naming the file."""


def _refusal(path, what: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(f"checkpoint file {path} holds {what}, {NEVER_HELD} (a DCP checkpoint holds only "
                            f"{METADATA_GLOBALS}, numbers, strings and tensors); it was not loaded, since unpickling "
                            "it would run code; fix: load an earlier step directory raymesh wrote, and find out who "
                            "wrote this file")


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what ``allowed_global`` names; ``persistent_load`` keeps pickle's refusal."""

    def __init__(self, stream, path):
        super().__init__(stream)
        self.path = path

    def find_class(self, module: str, name: str):
        found = allowed_global(module, name)
        if found is None:
            raise _refusal(self.path, f"{module}.{name}")
        return found


def read_metadata_file(stream, path) -> dcp_metadata.Metadata:
    """A DCP ``Metadata`` from ``stream`` (the file ``path``), read by the restricted unpickler; refused
    (``UnsafeCheckpoint``) when it names anything else, or is not a pickle of one at all."""
    try:
        metadata = _MetadataUnpickler(stream, path).load()
    except UnsafeCheckpoint:
        raise
    except Exception as exc:  # a damaged file: pickle raises UnpicklingError, EOFError, ValueError, TypeError...
        raise UnsafeCheckpoint(f"checkpoint file {path} is not a DCP metadata file ({type(exc).__name__}: {exc}); "
                               "fix: load an earlier step directory, or save this one again") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise _refusal(path, f"a {type(metadata).__name__} where DCP's Metadata belongs")
    return metadata


class _SafeMetadata:
    """``read_metadata`` of DCP's file-system readers with the restricted unpickler. A refusal is kept in
    ``refused``: DCP (2.13) answers a failed read by trying the rank-local metadata file and wraps what fails in
    its own exceptions, so ``dcp_load`` raises the refusal itself afterwards."""

    refused: UnsafeCheckpoint | None = None
    _read: dict | None = None  # rank (None: the global file) -> its metadata, read once per load

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        self._read = self._read if self._read is not None else {}
        if rank not in self._read:
            self._read[rank] = self._unpickled(rank)
        metadata = self._read[rank]
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as DCP's own reader does
        return metadata

    def _unpickled(self, rank: int | None) -> dcp_metadata.Metadata:
        path = self.fs.concat_path(self.path, METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
        try:
            with self.fs.create_stream(path, "rb") as stream:
                return read_metadata_file(stream, path)
        except UnsafeCheckpoint as exc:
            self.refused = self.refused or exc
            raise


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """DCP's local-file reader with the restricted metadata unpickler."""


def storage_reader(path: str | Path):
    """The reader of the checkpoint ``path``: local, or an object-store URL (DCP's fsspec reader, which DCP
    itself picks for a URL ``checkpoint_id``), reading its metadata without running code."""
    if not is_url(path):
        return SafeFileSystemReader(str(path))
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # where DCP itself takes it from

    class SafeFsspecReader(_SafeMetadata, FsspecReader):
        """DCP's fsspec reader with the restricted metadata unpickler."""

    return SafeFsspecReader(str(path))


# besides torch's weights_only list, what a non-tensor entry may hold: a BytesIO value (compression feedback) is
# stored by DCP as a pickled BytesIO
BYTES_GLOBALS = [io.BytesIO]


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, taking a non-tensor entry only once torch's ``weights_only`` unpickler has read it."""

    def __init__(self, *args, checkpoint: str | Path = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.checkpoint = checkpoint

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = value.read()
        try:
            with torch.serialization.safe_globals(BYTES_GLOBALS):
                torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as exc:
            named = re.search(r"GLOBAL ([\w.]+)", str(exc))  # torch's message, worded differently by version
            raise _refusal(f"{self.checkpoint} (entry {read_item.dest_index.fqn})",
                           named.group(1) if named else "an object outside torch's weights_only list") from None
        super().load_bytes(read_item, io.BytesIO(data))


def dcp_load(state: dict, checkpoint: str | Path, planner: SafeLoadPlanner | None = None, **kwargs) -> None:
    """``dcp.load`` of ``state`` from ``checkpoint`` (``kwargs``: its ``process_group`` or ``no_dist``) reading no
    object the checkpoint could run code with; a refusal (``UnsafeCheckpoint``, or the planner's) is raised as
    itself, not inside DCP's exception that carries every rank's traceback."""
    reader = storage_reader(checkpoint)
    reader.read_metadata()  # a refusal here is raised as it is: inside DCP it is logged with a traceback first
    planner = planner or SafeLoadPlanner(checkpoint=checkpoint)
    try:
        dcp.load(state, storage_reader=reader, planner=planner, **kwargs)
    except (CheckpointException, AssertionError, CheckpointRefusal) as exc:
        refused = reader.refused or _refusal_in(exc)
        if refused is None:
            raise
        raise type(refused)(str(refused)) from None


def _refusal_in(exc: BaseException) -> CheckpointRefusal | None:
    """``exc`` when it is a refusal, else the first refusal among DCP's per-rank failures it wraps (each a pair
    of the exception and its traceback)."""
    if isinstance(exc, CheckpointRefusal):
        return exc
    failures = getattr(exc, "failures", None) or {}
    return next((f[0] for f in failures.values() if isinstance(f[0], CheckpointRefusal)), None)


def read_metadata(checkpoint: str | Path) -> dcp_metadata.Metadata:
    """The checkpoint's DCP metadata alone (the keys, shapes and dtypes it holds), read without running code."""
    return storage_reader(checkpoint).read_metadata()
