"""Saved-activation offload and lossy compression, through ``torch.autograd.graph.saved_tensors_hooks``.

Autograd keeps every tensor a backward formula needs from forward until that
backward runs; these hooks intercept each one as it is saved:

- compression (Gist-style, off by default): floating tensors are kept in bf16,
  or in fp8 (e4m3) with a per-tensor scale, and cast back for backward. Lossy:
  gradients move by about the format's rounding error (bf16 ~2^-9, fp8 ~2^-4).
- offload: the (possibly compressed) tensor goes to the offload store; backward
  pops it back, prefetching the next ``prefetch`` tensors it will need (saved
  tensors come back in reverse order).

Parameters (and tensors sharing a parameter's storage), the document mask
every layer shares (``workers.model.documents.is_shared_mask``), integer
tensors and tiny tensors stay as they are: they are resident anyway, must not
be rounded, or cost more to move than they save. Tensors saved inside a recompute region
are the checkpoint's business (its own hooks win), so these hooks see only
what recompute keeps.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from workers.contract.sections import MemorySection
from workers.model.documents import is_shared_mask
from workers.offload.store import OffloadStore

MIN_NUMEL = 1024
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


class SavedActivations:
    def __init__(self, compression: str = "none", store: OffloadStore | None = None):
        self.compression = compression
        self.store = store
        self._ids = itertools.count()
        self.held_bytes = 0  # bytes in the store now
        self.peak_bytes = 0  # most bytes the store held at once

    @property
    def active(self) -> bool:
        return self.compression != "none" or self.store is not None

    def hooks(self):
        """Context for forward passes whose saved tensors this policy should handle."""
        if not self.active:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        if _is_parameter(t) or is_shared_mask(t) or not t.is_floating_point() or t.numel() < MIN_NUMEL:
            return t
        packed = _compress(t, self.compression)
        if self.store is None:
            return packed
        key = next(self._ids)
        value, rest = packed
        self.store.put(str(key), value)
        self.held_bytes += value.numel() * value.element_size()
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return key, value.shape, value.dtype, rest, t.device

    def unpack(self, packed):
        if torch.is_tensor(packed):
            return packed
        if self.store is None:
            return _restore(packed)
        key, _shape, _dtype, rest, device = packed
        for ahead in range(1, self.store.prefetch_depth + 1):
            if str(key - ahead) in self.store:
                self.store.prefetch(str(key - ahead))
        value = self.store.pop(str(key), device)
        self.held_bytes -= value.numel() * value.element_size()
        return _restore((value, rest))


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (``Linear`` saves ``weight.t()`` for its input gradient): resident anyway,
    and rounding it would move every gradient computed through the weight, not only the activation's share."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def _compress(t: torch.Tensor, compression: str) -> tuple[torch.Tensor, tuple]:
    """(stored tensor, what restoring needs: original dtype and fp8 scale)."""
    if compression == "bf16":
        return t.to(torch.bfloat16), (t.dtype, None)
    if compression == "fp8":
        amax = t.detach().abs().amax().float()
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return (t / scale).to(FP8), (t.dtype, scale)
    return t.detach(), (t.dtype, None)


def _restore(packed: tuple[torch.Tensor, tuple]) -> torch.Tensor:
    value, (dtype, scale) = packed
    if scale is not None:
        return (value.float() * scale.to(value.device)).to(dtype)
    return value.to(dtype)


def activation_policy(memory: MemorySection, device: torch.device) -> SavedActivations:
    """The job's policy from its ``memory`` section (``offload.activations``, ``activation_compression``)."""
    store = OffloadStore.from_spec(memory.offload, device) if memory.offload.activations else None
    return SavedActivations(memory.activation_compression, store)
