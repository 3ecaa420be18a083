"""A tiered tensor store: device -> host memory -> NVMe files, with background prefetch and eviction.

Our own code (PyTorch has no such store; DeepSpeed's swap tensors are the model):
everything that wants bytes off the accelerator — optimizer state, ZeRO-3
parameter shards, saved activations — puts tensors here under a key, and gets
them back just before it needs them.

- ``cpu`` tier: tensors live in host memory; on a GPU that memory is pinned and
  device<->host copies run on a side stream, so they overlap compute.
- ``nvme`` tier: one file per key under ``path``, memory-mapped with numpy. A
  ``get`` maps the file (zero copy, the kernel pages it in); prefetch touches
  the pages ahead of use on a background thread; ``release`` drops the mapping,
  so the pages leave this process's resident set and only the page cache (which
  the kernel may drop) keeps them. Files are allocated with ``posix_fallocate``
  so a full disk is a clean ``OSError`` rather than a SIGBUS on first write.

Writes (``put``) run on an eviction thread and reads ahead (``prefetch``) on a
prefetch thread; a ``get`` of a key waits for that key's pending write first,
so readers always see the last value put. At most ``prefetch + 1`` writes are
queued at once (``put`` blocks beyond that): without the bound a slow disk or a
busy machine lets evicted tensors pile up in host memory and the offload saves
nothing at the peak.
"""

from __future__ import annotations

import itertools
import mmap
import os
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from workers import orphans
from workers.contract.sections import OffloadSection
from workers.offload.host_memory import release_freed_buffers

TIERS = ("cpu", "nvme")


ORPHAN_PREFIX = "raymesh-offload-"


def remove_orphans(root: str | Path | None) -> list[Path]:
    """Delete offload directories under ``root`` whose owning process is gone (a SIGKILLed rank skips the
    store's own clean-up); returns them. A directory whose pid is alive, or reused, is left alone."""
    return orphans.remove_orphans(Path(root or tempfile.gettempdir()), ORPHAN_PREFIX)


class OffloadSpaceError(OSError):
    """The NVMe path lacks the space the store was asked to reserve."""


class OffloadStore:
    def __init__(self, tier: str, path: str | None = None, device: torch.device | str = "cpu", prefetch: int = 1):
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        self.tier = tier
        self.device = torch.device(device)
        self.prefetch_depth = prefetch
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._meta: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._host: dict[str, torch.Tensor] = {}  # cpu tier: the values; nvme tier: mapped (resident) keys
        self._writes: dict[str, Future] = {}
        self._reads: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._evictor = ThreadPoolExecutor(1, thread_name_prefix="offload-evict")
        self._queued_writes = threading.BoundedSemaphore(prefetch + 1)
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="offload-prefetch")
        self._dir: Path | None = None
        if tier == "nvme":
            root = Path(path or tempfile.gettempdir())
            root.mkdir(parents=True, exist_ok=True)
            # the pid in the name lets a later rank on this node remove it should this process be SIGKILLed
            self._dir = Path(tempfile.mkdtemp(prefix=orphans.owned_prefix(ORPHAN_PREFIX), dir=root))
            # the files go with the store, or at the latest when the rank's process exits
            self._remove_dir = weakref.finalize(self, shutil.rmtree, self._dir, True)
        self._files: dict[str, Path] = {}
        self._names = itertools.count()
        release_freed_buffers()

    @classmethod
    def from_spec(cls, offload: OffloadSection, device: torch.device | str) -> OffloadStore:
        """A store placed as the job's ``memory.offload`` section says (tier, path, prefetch depth)."""
        return cls(offload.tier, offload.path, device, offload.prefetch)

    # -- sizing ---------------------------------------------------------------------------------

    def reserve(self, nbytes: int) -> None:
        """Fail now, not mid-training, when the NVMe path cannot hold ``nbytes`` more."""
        if self._dir is None:
            return
        free = shutil.disk_usage(self._dir).free
        if nbytes > free:
            raise OffloadSpaceError(
                f"offload path {self._dir.parent} has {free / 2**30:.2f} GiB free, "
                f"the store needs {nbytes / 2**30:.2f} GiB"
            )

    @property
    def on_gpu(self) -> bool:
        """Whether the store serves a GPU (its host tensors are then pinned for asynchronous copies)."""
        return self._cuda

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(shape, dtype) for shape, dtype in self._meta.values())

    def __contains__(self, key: str) -> bool:
        return key in self._meta

    # -- writes (eviction) ------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor) -> None:
        """Store ``tensor`` under ``key`` asynchronously; the caller must not modify it afterwards."""
        tensor = tensor.detach()
        self._wait(self._reads.pop(key, None))
        self._wait(self._writes.pop(key, None))
        self._meta[key] = (tensor.shape, tensor.dtype)
        self._host.pop(key, None)
        event = None
        if tensor.device.type == "cuda":
            # device -> pinned host copy on the side stream; the writer waits on the event, not the caller
            staging = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self._stream):
                staging.copy_(tensor, non_blocking=True)
                tensor.record_stream(self._stream)
                event = torch.cuda.Event()
                event.record(self._stream)
            tensor = staging
        # boxed so the value is freed when written: the executor keeps its arguments a while after the result
        self._queued_writes.acquire()
        self._writes[key] = self._evictor.submit(self._write, key, [tensor], event)

    def zeros(self, key: str, shape: torch.Size, dtype: torch.dtype = torch.float32) -> None:
        """Store zeros under ``key`` without building them in memory first (an nvme file starts zeroed)."""
        if self.tier == "cpu":
            self.put(key, torch.zeros(shape, dtype=dtype, pin_memory=self._cuda))
            return
        self.delete(key)
        self._meta[key] = (torch.Size(shape), dtype)
        self._writes[key] = self._evictor.submit(self._allocate, key, _nbytes(torch.Size(shape), dtype))

    def _allocate(self, key: str, nbytes: int) -> Path:
        path = self._files.get(key) or self._dir / f"{next(self._names)}.bin"
        self._files[key] = path
        with open(path, "wb") as f:
            if nbytes:
                os.posix_fallocate(f.fileno(), 0, nbytes)  # ENOSPC here, not SIGBUS on a page fault later
        return path

    def _write(self, key: str, box: list[torch.Tensor], event) -> None:
        try:
            tensor = box.pop()
            if event is not None:
                event.synchronize()
            if self.tier == "cpu":
                self._host[key] = tensor if tensor.device.type == "cpu" else tensor.cpu()
                return
            nbytes = tensor.numel() * tensor.element_size()
            path = self._allocate(key, nbytes)
            if nbytes:
                with open(path, "r+b") as f, mmap.mmap(f.fileno(), nbytes) as mm:
                    mm[:] = memoryview(_bytes_view(tensor.contiguous()).numpy())
            del tensor
        finally:
            self._queued_writes.release()

    # -- reads (prefetch) ------------------------------------------------------------------------

    def prefetch(self, key: str) -> None:
        """Start bringing ``key`` into host memory (nvme) on the prefetch thread; no-op if resident."""
        if self.tier == "cpu" or key in self._host or key in self._reads:
            return
        write = self._writes.get(key)
        self._reads[key] = self._prefetcher.submit(self._map, key, write)

    def _map(self, key: str, write: Future | None) -> torch.Tensor:
        self._wait(write)
        shape, dtype = self._meta[key]
        nbytes = _nbytes(shape, dtype)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        array = np.memmap(self._files[key], dtype=np.uint8, mode="r+", shape=(nbytes,))
        array[:: mmap.PAGESIZE].sum()  # touch every page: the disk read happens here, off the caller's thread
        return torch.from_numpy(array).view(dtype).view(shape)

    def get(self, key: str) -> torch.Tensor:
        """The host-resident tensor for ``key``; in-place changes persist (it is the stored value)."""
        if key in self._host:
            return self._host[key]
        if self.tier == "cpu":
            self._wait(self._writes.pop(key, None))
            return self._host[key]
        read = self._reads.pop(key, None)
        tensor = read.result() if read is not None else self._map(key, self._writes.get(key))
        self._writes.pop(key, None)
        self._host[key] = tensor
        return tensor

    def fetch(self, key: str, device: torch.device | None = None) -> torch.Tensor:
        """A copy of ``key`` on ``device`` (default: the store's device); on a GPU copied on the side stream."""
        device = torch.device(device or self.device)
        host = self.get(key)
        if device.type != "cuda":
            return host.clone()
        with torch.cuda.stream(self._stream):
            out = host.to(device, non_blocking=True)
        torch.cuda.current_stream(device).wait_stream(self._stream)
        out.record_stream(torch.cuda.current_stream(device))
        return out

    def release(self, key: str) -> None:
        """Drop ``key``'s residency: an nvme mapping is unmapped once the caller's references are gone."""
        if self.tier == "nvme":
            self._host.pop(key, None)

    def pop(self, key: str, device: torch.device | None = None) -> torch.Tensor:
        """``fetch`` then ``delete``: for values read exactly once (saved activations)."""
        out = self.fetch(key, device)
        self.delete(key)
        return out

    def delete(self, key: str) -> None:
        self._wait(self._reads.pop(key, None))
        self._wait(self._writes.pop(key, None))
        self._meta.pop(key, None)
        self._host.pop(key, None)
        path = self._files.pop(key, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        for key in list(self._meta):
            self.delete(key)
        self._evictor.shutdown()
        self._prefetcher.shutdown()
        if self._dir is not None:
            self._remove_dir()

    @staticmethod
    def _wait(future: Future | None) -> None:
        if future is not None:
            future.result()


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return shape.numel() * torch.empty((), dtype=dtype).element_size()


def _bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 CPU tensor (numpy has no bf16/fp8, bytes go everywhere)."""
    return tensor.reshape(-1).view(torch.uint8)
