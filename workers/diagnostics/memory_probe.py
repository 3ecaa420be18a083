"""Measures what the planner's memory model predicts, inside a rank, in bytes of real tensors.

Two measurements, both by storage so views and shared buffers count once:

- ``model_state_bytes``: the local shards (a DTensor's local tensor) of the
  parameters, gradients and optimizer state this rank holds, taken after the
  optimizer step and before the gradients are dropped, when all three exist.
- ``ActivationMeter``: the live bytes of tensors saved for backward, peak over
  a window (a whole step, so the microbatches a pipeline schedule keeps in
  flight show up). ``torch.autograd.graph.saved_tensors_hooks`` sees each saved
  tensor; the packed handle's lifetime is the saved tensor's, so when autograd
  frees a graph the bytes leave the count. Tensors whose storage is a
  parameter's are weights, not activations, and are skipped. Recompute's
  ``checkpoint`` saves through its own inner hooks and keeps only the inputs of
  the modules it wraps (in a closure no hook sees), so the meter counts those
  inputs with a forward pre-hook for as long as they stay alive (so a pipeline
  stage's receive buffer, which outlives its backward, stays counted: the one
  layout where measured exceeds predicted by more than 1%, interleaved 1F1B
  with full recompute, by that one buffer). Under ZeRO-R's Pa (``memory.partition_activations``) those inputs
  are not kept: the slices kept instead are counted as ``InputSlices`` reports them, the device ones here and
  the host ones (Pa+cpu) apart, as ``host_peak``.

- ``ActivationMeter.step_peak``: the in-step peak of everything above together, sampled at every
  pack (forward) and unpack (backward) of a saved tensor and at the end of backward: saved tensors
  plus the live storages of parameters, gradients and optimizer state at that moment
  (``live_state_bytes``), which sees FSDP2's transient unsharded parameters and the full-size
  gradients it holds until the last microbatch; the model-state bytes above, taken after the
  optimizer step, miss both. The optimizer's own step (its temporaries) is not sampled.

Our own code: PyTorch has hooks but no per-category tensor accounting.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from workers.model.nf4 import NF4Linear


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding the memory under wrapper subclasses (DTensor, funcol's AsyncCollectiveTensor)."""
    while type(t) is not torch.Tensor and type(t) is not nn.Parameter and hasattr(t, "__tensor_flatten__"):
        inner, _ = t.__tensor_flatten__()
        t = getattr(t, inner[0])
    return t


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = _plain(t).untyped_storage()
    return s.data_ptr(), s.nbytes()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (local shards of DTensors)."""
    seen = dict(_storage(t) for t in tensors if t is not None)
    return sum(seen.values())


def _optimizer_tensors(opt: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for state in opt.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def model_state_bytes(modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[str, int]:
    """QLoRA's NF4 base weights are module buffers (``workers.model.nf4``): they count as parameters."""
    params = [p for m in modules for p in m.parameters()]
    nf4 = [b for m in modules for mod in m.modules() if isinstance(mod, NF4Linear) for b in mod.buffers()]
    return {
        "params": tensor_bytes(params + nf4),
        "grads": tensor_bytes(p.grad for p in params),
        "optimizer": tensor_bytes(t for o in optimizers for t in _optimizer_tensors(o)),
    }


def _fsdp_tensors(modules: list[nn.Module]) -> Iterable[torch.Tensor]:
    """FSDP2's own copies of each parameter: the sharded one, the unsharded one (its storage is resized
    to 0 while resharded) and their gradients, incl. the unsharded gradient accumulated without sync.
    Private attributes of ``FSDPParam`` (torch 2.11-2.13), read with ``getattr`` so a rename reads as 0."""
    for module in (m for part in modules for m in part.modules() if isinstance(m, FSDPModule)):
        group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            for name in ("sharded_param", "_unsharded_param"):
                t = getattr(fsdp_param, name, None)
                if t is not None:
                    yield t
                    yield t.grad
            yield getattr(fsdp_param, "unsharded_accumulated_grad", None)


def live_state_bytes(modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes of the distinct storages of parameters, gradients and optimizer state alive right now."""
    params = [p for m in modules for p in m.parameters()]
    nf4 = [b for m in modules for mod in m.modules() if isinstance(mod, NF4Linear) for b in mod.buffers()]
    state = [t for o in optimizers for t in _optimizer_tensors(o)]
    return tensor_bytes([*params, *(p.grad for p in params), *nf4, *state, *_fsdp_tensors(modules)])


class _Held:
    """One saved tensor as autograd stores it; its death releases the bytes it counted."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ActivationMeter:
    """Context manager: peak live bytes saved for backward by ``modules`` (see module docstring)."""

    def __init__(self, modules: list[nn.Module], checkpointed: list[nn.Module],
                 state_bytes: Callable[[], int] | None = None, slices: Any = None):
        self.modules, self.checkpointed, self.state_bytes = modules, checkpointed, state_bytes
        self.slices = slices  # Pa's ``InputSlices`` (a higher layer: only its ``listeners`` list is used)
        self.live: dict[int, list[int]] = {}  # storage ptr -> [holders alive, bytes]
        self.current = self.peak = self.step_peak = 0
        self.host = self.host_peak = 0  # Pa+cpu: input slices kept in host memory (never in ``current``)
        self._hooks = None
        self._handles: list = []

    def _param_storages(self) -> set[int]:
        # read at each pack: FSDP2 swaps unsharded parameters in and out during forward
        return {_storage(p)[0] for m in self.modules for p in m.parameters()}

    def _hold(self, t: torch.Tensor, holder: object) -> None:
        ptr, nbytes = _storage(t)
        entry = self.live.setdefault(ptr, [0, nbytes])
        if entry[0] == 0:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        weakref.finalize(holder, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]

    def _sample(self) -> None:
        """In-step peak: saved tensors plus model state as they are now (only with ``state_bytes``)."""
        if self.state_bytes is not None:
            self.step_peak = max(self.step_peak, self.current + self.state_bytes())

    def _pack(self, t: torch.Tensor):
        held = _Held(t)
        # meta tensors (a pipeline stage's shape inference) hold no memory
        if t.device.type != "meta" and _storage(t)[0] not in self._param_storages():
            self._hold(t, held)
            self._sample()
        return held

    def _unpack(self, held: _Held) -> torch.Tensor:
        self._sample()
        return held.tensor

    def _kept(self, part: torch.Tensor, place: str) -> None:
        """A recomputed block's input slice (ZeRO-R's Pa): activations where it stays on the device, else host
        bytes, counted for as long as the slice lives."""
        if place == "device":
            self._hold(part, part)
            self._sample()
            return
        self.host += part.untyped_storage().nbytes()
        self.host_peak = max(self.host_peak, self.host)
        weakref.finalize(part, self._host_release, part.untyped_storage().nbytes())

    def _host_release(self, nbytes: int) -> None:
        self.host -= nbytes

    def _pre_hook(self, module: nn.Module, args: tuple) -> None:
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad:
                self._hold(a, a)

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._handles = [m.register_forward_pre_hook(self._pre_hook) for m in self.checkpointed]
        if self.slices is not None:
            self.slices.listeners.append(self._kept)
        return self

    def __exit__(self, *exc) -> None:
        self._sample()  # the end of backward: every gradient there, few activations left
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        if self.slices is not None:
            self.slices.listeners.remove(self._kept)
