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

from workers.state.train_state import TrainState


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def take(state: TrainState) -> dict:
    model, optim = {}, {}
    with torch.no_grad(), state.resident(write_back=False):
        for named, stepped, opt in state.named_parts():
            for name, p in named:
                model[name] = _local(p).to("cpu", copy=True)
            for name, p in stepped:
                if p in opt.state:
                    optim[name] = {
                        k: _local(v).to("cpu", copy=True) if torch.is_tensor(v) else v for k, v in opt.state[p].items()
                    }
    # an asynchronous pipeline's versions and in-flight microbatches, already serialized (a copy) by its state_dict
    versions = state.weight_versions.state_dict() if state.weight_versions is not None else {}
    feedback = state.wire_feedback.state_dict() if state.wire_feedback is not None else {}
    return {"model": model, "optim": optim, "progress": copy.deepcopy(state.progress_state()),
            "weight_versions": versions, "wire_feedback": feedback}


def restore(state: TrainState, snap: dict) -> None:
    """Copy a snapshot taken at this grid position back into ``state``'s shards, bit for bit."""
    with torch.no_grad(), state.resident():
        for named, stepped, opt in state.named_parts():
            for name, p in named:
                _local(p).copy_(snap["model"][name])
            for name, p in stepped:
                if name in snap["optim"]:
                    opt.state[p] = {k: _like(p, v) for k, v in snap["optim"][name].items()}
    state.load_progress_state(snap["progress"])
    state.load_weight_versions(snap.get("weight_versions", {}))
    if state.wire_feedback is not None:
        state.wire_feedback.load_state_dict(snap.get("wire_feedback", {}))


def _like(param: torch.Tensor, saved):
    """Optimizer state shaped like the parameter becomes a tensor placed like it; scalars stay as saved."""
    if not torch.is_tensor(saved):
        return saved
    if saved.shape == _local(param).shape and saved.dim() > 0:
        state = torch.zeros_like(param)
        _local(state).copy_(saved)
        return state
    return saved.clone()
