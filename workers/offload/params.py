"""ZeRO-3 parameter offload (ZeRO-Infinity style): each FSDP2 unit's local shard lives in the offload store.

FSDP2 keeps a rank's shard of each parameter in its ``FSDPParam``'s flat
``_sharded_param_data`` (the parameter DTensor's ``_local_tensor`` is a view of
it) and reads that shard only when it all-gathers the unit
(``FSDPParamGroup.unshard``, called from its forward/backward hooks and
prefetches). FSDP2 offers no hook around that read, and its own
``CPUOffloadPolicy`` keeps shards in (pinned) host memory, not on disk, and
needs a GPU driver — so this is our own: each group's ``unshard`` is wrapped to
*fetch* (give the storage its bytes back, copy the stored shard in, start
prefetching the next ``prefetch`` units in the direction of travel) and its
``wait_for_unshard`` to *evict* once the gather has consumed the shard
(``untyped_storage().resize_(0)``, as FSDP does to its unsharded parameters).

The stored copy is the authoritative value: forward and backward never write
a shard, so evicting writes nothing; the optimizer step (``OffloadedAdam``
given ``shards=``) updates the stored tensor in place, on the host; checkpoint
saves/loads and snapshots run inside ``resident()``, which fetches every shard
(and, after a load or restore, writes them back on exit).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from workers.contract.sections import OffloadSection
from workers.offload.store import OffloadStore


def offload_params(modules: list[nn.Module], offload: OffloadSection, device: torch.device) -> ParamOffload | None:
    """The job's parameter offload (``memory.offload``) over its FSDP2 stage modules, or ``None`` when not asked
    for."""
    if not offload.params:
        return None
    return ParamOffload(modules, OffloadStore.from_spec(offload, device))


class ParamOffload:
    def __init__(self, modules: list[nn.Module], store: OffloadStore):
        self.store = store
        # units in forward order: FSDP2 gathers a stage's root group first, then its blocks
        groups = [m._get_fsdp_state()._fsdp_param_group for part in modules for m in _fsdp_modules(part)]
        groups = [g for g in groups if g is not None]  # a module with no parameters of its own has no group
        self.units = [list(g.fsdp_params) for g in groups]
        self._keys = {fp: f"u{u}.{i}" for u, unit in enumerate(self.units) for i, fp in enumerate(unit)}
        self._by_param = {fp.sharded_param: fp for fp in self._keys}
        self._last = -1
        store.reserve(sum(_nbytes(fp._sharded_param_data) for fp in self._keys))
        for index, group in enumerate(groups):
            group.unshard = _before(group.unshard, functools.partial(self._gathering, group, index))
            group.wait_for_unshard = _after(group.wait_for_unshard, functools.partial(self.evict_unit, index))
        for fp, key in self._keys.items():
            data = fp._sharded_param_data
            self.store.zeros(key, data.shape, data.dtype)
            self.store.get(key).copy_(data)
            self.store.release(key)
            # FSDP's lazy init re-pads a shard whose local size differs from the padded one, reading it:
            # such shards leave at their first gather instead of now
            if fp.sharded_param._local_tensor.size() == fp.padded_sharded_param_size:
                _free(data)

    # -- the unit hooks -------------------------------------------------------------------------

    def _gathering(self, group, index: int) -> None:
        """Before ``group.unshard``: fetch only when it will really all-gather (not pending, not gathered)."""
        if group._all_gather_result is None and not group.is_unsharded:
            self.fetch_unit(index)

    def fetch_unit(self, index: int) -> None:
        step = 1 if index > self._last else -1
        self._last = index
        for fp in self.units[index]:
            self._fetch(fp)
        for ahead in range(index + step, index + step * (self.store.prefetch_depth + 1), step):
            if 0 <= ahead < len(self.units):
                for fp in self.units[ahead]:
                    self.store.prefetch(self._keys[fp])

    def evict_unit(self, index: int) -> None:
        for fp in self.units[index]:
            _free(fp._sharded_param_data)

    def _fetch(self, fp) -> None:
        data = fp._sharded_param_data
        storage = data.untyped_storage()
        if storage.size() == 0:
            storage.resize_(_nbytes(data))
            data.copy_(self.store.get(self._keys[fp]))
            self.store.release(self._keys[fp])

    # -- what the optimizer, checkpoints and snapshots use ------------------------------------------

    def host_shard(self, param: torch.Tensor) -> torch.Tensor | None:
        """The stored (host) shard of ``param``, shaped like its local tensor; writes to it persist."""
        fp = self._by_param.get(param)
        if fp is None:
            return None
        local = fp.sharded_param._local_tensor
        return self.store.get(self._keys[fp])[: local.numel()].view(local.shape)

    def prefetch(self, param: torch.Tensor) -> None:
        if param in self._by_param:
            self.store.prefetch(self._keys[self._by_param[param]])

    def release(self, param: torch.Tensor) -> None:
        if param in self._by_param:
            self.store.release(self._keys[self._by_param[param]])

    @contextlib.contextmanager
    def resident(self, write_back: bool = True):
        """Every shard on the device for the block (checkpoint I/O, snapshots), then evicted again; written
        back to the store only when the block changed them (loads, restores), not after saves and snapshots."""
        for fp in self._keys:
            self._fetch(fp)
        try:
            yield
        finally:
            for fp, key in self._keys.items():
                if write_back:
                    self.store.get(key).copy_(fp._sharded_param_data)
                    self.store.release(key)
                _free(fp._sharded_param_data)

    def close(self) -> None:
        self.store.close()


def _fsdp_modules(part: nn.Module):
    return [m for m in part.modules() if isinstance(m, FSDPModule)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _free(t: torch.Tensor) -> None:
    if t.untyped_storage().size():
        t.untyped_storage().resize_(0)


def _before(method, hook):
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        hook()
        return method(*args, **kwargs)
    return wrapped


def _after(method, hook):
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        out = method(*args, **kwargs)
        hook()
        return out
    return wrapped
