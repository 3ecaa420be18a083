"""Make freed host buffers go back to the OS at once, so offloading actually lowers resident memory.

glibc serves big allocations with mmap, but raises that threshold each time
such a block is freed (up to 32 MiB); from then on multi-MB tensors come from
the heap, and freed heap space between live blocks stays resident. An
offloading rank streams many parameter-sized temporaries through the host
(optimizer math, staged shards), so that heap would keep much of what the
store moved out. Fixing the threshold with ``mallopt`` (which also turns the
adjustment off) unmaps every large buffer when it is freed. Elsewhere than
glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value
_done = False


def release_freed_buffers() -> None:
    global _done
    if _done:
        return
    _done = True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)
    except (OSError, AttributeError, TypeError):
        pass  # not glibc: its allocator keeps its own policy
