"""In-memory snapshots of one rank's training state, for recovery without storage (Gemini-style).

A snapshot holds this rank's *local* shards (plain CPU tensors, keyed by
parameter name) of the weights and optimizer state plus the training
progress. It is restored into a trainer rebuilt at the same grid position,
so shards map one to one and no resharding (hence no DCP) is needed; being
plain tensors it pickles, so a peer on another node can hold a replica.
DCP checkpoints on disk remain the fallback when both copies are gone.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

from workers.parallel.data_parallel import unwrap
from workers.state.checkpoint_io import local_optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _named_parts(trainer):
    for part, opt in zip(trainer.parts.modules, trainer.optimizers):
        yield unwrap(part).named_parameters(), local_optimizer(opt)


def take(trainer) -> dict:
    model, optim = {}, {}
    with torch.no_grad(), trainer.resident_params(write_back=False):
        for named, opt in _named_parts(trainer):
            for name, p in named:
                model[name] = _local(p).to("cpu", copy=True)
                if p in opt.state:
                    optim[name] = {
                        k: _local(v).to("cpu", copy=True) if torch.is_tensor(v) else v for k, v in opt.state[p].items()
                    }
    return {"model": model, "optim": optim, "progress": copy.deepcopy(trainer.progress_state())}


def restore(trainer, snap: dict) -> None:
    """Copy a snapshot taken at this grid position back into ``trainer``'s shards, bit for bit."""
    with torch.no_grad(), trainer.resident_params():
        for named, opt in _named_parts(trainer):
            for name, p in named:
                _local(p).copy_(snap["model"][name])
                if name in snap["optim"]:
                    opt.state[p] = {k: _like(p, v) for k, v in snap["optim"][name].items()}
    trainer.load_progress_state(snap["progress"])


def _like(param: torch.Tensor, saved):
    """Optimizer state shaped like the parameter becomes a tensor placed like it; scalars stay as saved."""
    if not torch.is_tensor(saved):
        return saved
    if saved.shape == _local(param).shape and saved.dim() > 0:
        state = torch.zeros_like(param)
        _local(state).copy_(saved)
        return state
    return saved.clone()
