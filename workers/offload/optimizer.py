"""Adam/AdamW with its state in an ``OffloadStore``: ZeRO-Offload, and the paged AdamW optimizer.

Our own wrapper around PyTorch's functional ``adam`` (the math is PyTorch's fused kernel, so
results match ``torch.optim.AdamW(fused=True)`` bit for bit). What differs is where the
state lives: the Adam moments — and fp32 master weights, when the device
parameter is not already an fp32 host tensor — sit in the store, not next to
the parameters. The step runs on the host, one parameter at a time over this
rank's *local* shard (FSDP2 zero 2/3 and tensor parallelism hand it DTensors; their
local tensors are exactly the rank's shard), while the next parameter's state
is prefetched; the updated master is copied back into the device parameter and
the state is released, so at most a parameter or two of state is resident.
With ZeRO-3 parameter offload (``shards``, a ``ParamOffload``) the shard it
updates is the stored one, in place on the host: the device never holds it
for the step. Each parameter's gradient reaches the host while the parameter before it steps
(``workers.offload.grad_pipeline``).

``self.state[p]`` is a ``StoredState`` mapping that reads and writes through
the store, so ``state_dict``/DCP checkpoints and in-memory snapshots see the
moments like any PyTorch optimizer's; plain dicts put there by
``load_state_dict`` or a snapshot restore are moved into the store on the next
step. A parameter narrower than fp32 (bf16) also saves its master: rebuilt from
the rounded parameter, a resumed run would step other weights than an
uninterrupted one.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from workers.offload.grad_pipeline import GradPipeline
from workers.offload.store import OffloadStore

MOMENTS = ("exp_avg", "exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def needs_master(param: torch.Tensor) -> bool:
    """A host fp32 parameter is its own master copy; any other needs one in the store."""
    local = _local(param)
    return local.device.type != "cpu" or local.dtype != torch.float32


def _host_fp32(t: torch.Tensor, pin: bool = False) -> torch.Tensor:
    """What the store keeps of a tensor of state: a host fp32 copy of the local shard, in pinned memory when
    the parameters live on a GPU (the updated master is then copied back without blocking the host)."""
    local = _local(t).detach()
    return torch.empty(local.shape, dtype=torch.float32, pin_memory=pin).copy_(local)


def saved_keys(param: torch.Tensor) -> tuple[str, ...]:
    """The stored tensors a checkpoint of ``param`` carries: the moments, and the master where the parameter
    rounds it (an fp32 parameter on the device equals its master after every step, so it is left out)."""
    return (*MOMENTS, "master") if _local(param).dtype != torch.float32 else MOMENTS


class StoredState(MutableMapping):
    """One parameter's optimizer state: scalars in memory, tensors in the store (read as copies); it lists the
    stored ``saved`` keys only."""

    def __init__(self, store: OffloadStore, prefix: str, saved: tuple[str, ...] = MOMENTS):
        self.store, self.prefix, self.small, self.saved = store, prefix, {}, saved

    def __getitem__(self, k):
        if k in self.small:
            return self.small[k]
        if self.prefix + k in self.store:
            return self.store.fetch(self.prefix + k, "cpu")
        raise KeyError(k)

    def __setitem__(self, k, v):
        if torch.is_tensor(v) and v.dim() > 0:
            self.store.put(self.prefix + k, _host_fp32(v))
        else:
            self.small[k] = v

    def __delitem__(self, k):
        if k in self.small:
            del self.small[k]
        else:
            self.store.delete(self.prefix + k)

    def __iter__(self):
        yield from self.small
        yield from (k for k in self.saved if self.prefix + k in self.store)

    def __len__(self):
        return len(list(iter(self)))


class OffloadedAdam(torch.optim.Optimizer):
    def __init__(self, params, store: OffloadStore, lr: float, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 eps: float = 1e-8, decoupled_weight_decay: bool = True, shards=None):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay, "eps": eps})
        self.store = store
        self.shards = shards
        self.decoupled_weight_decay = decoupled_weight_decay
        self._grads = GradPipeline()  # gradients reach the host one parameter ahead of the step
        self._keys = {}
        for p in self._params():
            self._keys[p] = f"p{len(self._keys)}."
        store.reserve(sum(self.state_bytes(p) for p in self._keys))

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    @staticmethod
    def state_bytes(param: torch.Tensor) -> int:
        """Store bytes for one parameter: two fp32 moments, plus an fp32 master where one is needed."""
        return _local(param).numel() * 4 * (len(MOMENTS) + needs_master(param))

    def _target(self, p) -> torch.Tensor:
        """The tensor the step updates: the stored shard under parameter offload, else the local one."""
        shard = self.shards.host_shard(p) if self.shards is not None else None
        return _local(p) if shard is None else shard

    def _state(self, p, local: torch.Tensor) -> StoredState:
        state = self.state[p]
        if isinstance(state, StoredState):
            return state
        stored = StoredState(self.store, self._keys[p], saved_keys(local))
        for k in MOMENTS:
            if k in state:
                self.store.put(stored.prefix + k, _host_fp32(state[k]))
            else:
                self.store.zeros(stored.prefix + k, local.shape)
        stored["step"] = state.get("step", torch.tensor(0.0))
        if needs_master(local):  # the saved master, else (a first step, an older checkpoint) the parameter
            self.store.put(stored.prefix + "master", _host_fp32(state.get("master", local), self.store.on_gpu))
        self.state[p] = stored
        return stored

    def _prefetch(self, p) -> None:
        prefix = self._keys[p]
        for k in (*MOMENTS, "master"):
            if prefix + k in self.store:
                self.store.prefetch(prefix + k)
        if self.shards is not None:
            self.shards.prefetch(p)

    @torch.no_grad()
    def step(self, closure=None):
        """Each parameter's host step, the next parameter's gradient copy and state prefetch started before it
        (``GradPipeline``: the copy of one gradient overlaps the host step of another)."""
        loss = closure() if closure is not None else None
        todo = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if todo:
            self._grads.start(0, _local(todo[0][1].grad))
        for i, (group, p) in enumerate(todo):
            if i + 1 < len(todo):
                self._grads.start(i + 1, _local(todo[i + 1][1].grad))
                if isinstance(self.state[todo[i + 1][1]], StoredState):
                    self._prefetch(todo[i + 1][1])
            self._step_one(group, p, self._grads.take(i))
        return loss

    def _step_one(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Adam on the host for ``p``, whose gradient ``grad`` is already a host fp32 tensor."""
        local = self._target(p)
        state = self._state(p, local)
        prefix = state.prefix
        master = self.store.get(prefix + "master") if needs_master(local) else local
        exp_avg, exp_avg_sq = (self.store.get(prefix + k) for k in MOMENTS)
        beta1, beta2 = group["betas"]
        # fused: PyTorch's one-pass CPU kernel, 7x its single-tensor path on a 2-core host (the host step is
        # what an offloaded 1B model's training step waits on, README "GPU")
        adam([master], [grad], [exp_avg], [exp_avg_sq], [], [state["step"]], fused=True,
             decoupled_weight_decay=self.decoupled_weight_decay, amsgrad=False, beta1=beta1, beta2=beta2,
             lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        if master is not local:
            local.copy_(master, non_blocking=True)
        del master, exp_avg, exp_avg_sq, local
        for k in (*MOMENTS, "master"):
            self.store.release(prefix + k)
        if self.shards is not None:
            self.shards.release(p)

    def state_dict(self):
        """PyTorch's layout with the stored moments read back, shaped (DTensor or not) like their parameters."""
        out = super().state_dict()
        for index, p in enumerate(self._params()):
            if index in out["state"]:
                out["state"][index] = {k: _like(p, v) for k, v in self.state[p].items()}
        return out

    def load_state_dict(self, state_dict):
        """PyTorch's load, then each parameter's tensors as saved: PyTorch casts them to the parameter's dtype,
        which would round a bf16 parameter's fp32 moments and master."""
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for index, p in zip(ids, self._params()):
            if index in saved:
                self.state[p] = dict(saved[index])


def _like(param: torch.Tensor, value):
    if not (torch.is_tensor(value) and value.dim() > 0):
        return value
    value = value.to(_local(param).device)
    if isinstance(param, DTensor):
        return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return value
