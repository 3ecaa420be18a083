"""A paged optimizer: the state stays beside the parameters and leaves for the offload store only under pressure.

What the seed describes (QLoRA's paged optimizers: "when memory use runs high, move part of the optimizer's work to
CPU memory") and what ``optim.name: paged_adamw`` alone does not: that one keeps Adam's state in the store always
(``workers/offload/optimizer.py``), paying a host round trip every step even when the device has room. Here any
PyTorch optimizer steps on the device as usual, and a ``StatePager`` attached to it through the optimizer's own
hooks decides after each step from the memory the step used:

* ``pressure`` = (the step's peak bytes + the state bytes that were in the store during it) / capacity: what the
  peak would have been with the state resident. At or above ``page_at`` the state's tensors are put in the store
  (freeing their device memory for the next forward and backward); below it they stay (or come back) resident.
* Before each step (and before ``state_dict``, so checkpoints and snapshots see every tensor) the stored state is
  fetched back where it was, exactly: the same tensors, bit for bit, so a paged run's weights equal an unpaged
  run's. A ``load_state_dict`` replaces it, so the stored copies are dropped first.

The peak is read by a ``probe`` (``device_probe``): on CUDA PyTorch's allocator peak since the last step over the
device's total memory; on a CPU device the process's resident set over the host's memory (a CPU device pages to the
nvme tier: paging to host memory would relieve nothing, which the spec refuses). Tests pass their own probe.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from workers.offload.store import OffloadStore

# a probe returns (peak bytes since the last call, capacity bytes)
Probe = Callable[[], tuple[int, int]]


def _cuda_probe(device: torch.device) -> tuple[int, int]:
    """The allocator's peak since the last call over the device's memory; the peak restarts for the next step."""
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak, torch.cuda.get_device_properties(device).total_memory


def _host_probe() -> tuple[int, int]:
    """The process's resident bytes now over the host's physical memory (Linux ``/proc``; 0 elsewhere)."""
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * page
    except OSError:
        resident = 0
    return resident, os.sysconf("SC_PHYS_PAGES") * page


def device_probe(device: torch.device | str) -> Probe:
    """The memory probe of ``device`` (module doc)."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: _cuda_probe(device)
    return _host_probe


@dataclass
class _Paged:
    """One state tensor in the store: where it came from, so it comes back as it was."""

    key: str
    device: torch.device
    spec: tuple | None  # (mesh, placements, shape, stride) of a DTensor, None for a plain tensor


class StatePager:
    """Pages ``optimizer``'s state tensors to ``store`` when a step's ``pressure`` reaches ``page_at`` (module
    doc). ``pages_out``/``pages_in`` count the moves and ``last_pressure`` is the last decision's input, for the
    step records and the tests."""

    def __init__(self, optimizer: torch.optim.Optimizer, store: OffloadStore, page_at: float, probe: Probe):
        if not 0 < page_at < 1:
            raise ValueError(f"memory.offload.page_at {page_at} must be a fraction of device memory in (0, 1); "
                             "fix: e.g. 0.9 pages the state out when a step reaches 90% of the device")
        self.optimizer, self.store, self.page_at, self.probe = optimizer, store, page_at, probe
        self.paged: dict[tuple[int, str], _Paged] = {}
        self.pages_out = self.pages_in = 0
        self.last_pressure: float | None = None
        self._absent_bytes = 0  # state bytes in the store during the step being measured
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.page_in())
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.after_step())
        optimizer.register_state_dict_pre_hook(lambda opt: self.page_in())
        optimizer.register_load_state_dict_pre_hook(lambda opt, state_dict: self.drop())
        optimizer.pager = self  # lives as long as its optimizer

    @property
    def is_paged(self) -> bool:
        return bool(self.paged)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _tensors(self):
        """``(index, key, tensor)`` of every state tensor worth moving (scalars such as ``step`` stay)."""
        for index, p in enumerate(self._params()):
            for key, value in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    yield index, key, value

    def after_step(self) -> None:
        """Decide from the step's memory whether the state leaves until the next step (module doc)."""
        peak, capacity = self.probe()
        self.last_pressure = (peak + self._absent_bytes) / capacity if capacity else 0.0
        self._absent_bytes = 0
        if self.last_pressure >= self.page_at:
            self.page_out()

    def page_out(self) -> None:
        """Every state tensor into the store; the optimizer's state keeps only its scalars meanwhile."""
        params = self._params()
        for index, key, value in list(self._tensors()):
            local = value.to_local() if isinstance(value, DTensor) else value
            spec = (value.device_mesh, value.placements, value.shape, value.stride()) \
                if isinstance(value, DTensor) else None
            name = f"paged.{index}.{key}"
            self.store.put(name, local)
            self.paged[(index, key)] = _Paged(name, local.device, spec)
            self._absent_bytes += local.numel() * local.element_size()
            del self.optimizer.state[params[index]][key]
        self.pages_out += 1

    def page_in(self) -> None:
        """Every stored tensor back into the optimizer's state, where and as it was."""
        if not self.paged:
            return
        params = self._params()
        for (index, key), paged in self.paged.items():
            local = self.store.fetch(paged.key, paged.device)
            self.store.delete(paged.key)
            if paged.spec is not None:
                mesh, placements, shape, stride = paged.spec
                local = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
            self.optimizer.state[params[index]][key] = local
        self.paged.clear()
        self.pages_in += 1

    def drop(self) -> None:
        """Forget the stored copies: a ``load_state_dict`` is about to replace the whole state."""
        for paged in self.paged.values():
            self.store.delete(paged.key)
        self.paged.clear()
