"""In-memory snapshots of one rank's training state, for recovery without storage (Gemini-style).

A snapshot holds this rank's *local* shards (plain CPU tensors, keyed by
parameter name) of the weights, persistent buffers (an MoE router's balancing
bias moves every step) and optimizer state, plus the training progress. It is
restored into a trainer rebuilt at the same grid position, or into the live one
after a NaN step, so shards map one to one and no resharding (hence no DCP) is
needed; being plain tensors it pickles, so a peer on another node can hold a
replica.
DCP checkpoints on disk remain the fallback when both copies are gone.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from workers.model.names import unwrap
from workers.state import lossless
from workers.state.train_state import TrainState


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _persistent_buffers(state: TrainState) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers the model parts' state dicts carry (a DCP checkpoint has them too); non-persistent ones
    (NF4's quantisation tables) are rebuilt from the weights and stay out."""
    for part in state.modules:
        for prefix, mod in unwrap(part).named_modules():
            for name, buf in mod.named_buffers(recurse=False):
                if name not in mod._non_persistent_buffers_set:
                    yield f"{prefix}.{name}" if prefix else name, buf


def take(state: TrainState, compress: bool = False) -> dict:
    """A host copy of this rank's state (model shards, optimizer state, buffers, progress); with ``compress``
    every tensor losslessly compressed (``workers.state.lossless``: ``fault_tolerance.snapshot_compression``)."""
    snap = _copy(state)
    return lossless.pack(snap) if compress else snap


def _copy(state: TrainState) -> dict:
    model, buffers, optim, masters = {}, {}, {}, {}
    with torch.no_grad(), state.resident(write_back=False):
        for named, stepped, opt in state.named_parts():
            for name, p in named:
                model[name] = _local(p).to("cpu", copy=True)
            for name, p in stepped:
                if state.masters_apart:  # ZeRO-1's exact fp32 slices, apart from the rounded parameters
                    masters[name] = _local(p).to("cpu", copy=True)
                if p in opt.state:
                    optim[name] = {
                        k: _local(v).to("cpu", copy=True) if torch.is_tensor(v) else v for k, v in opt.state[p].items()
                    }
        for name, b in _persistent_buffers(state):
            buffers[name] = _local(b).to("cpu", copy=True)
    # an asynchronous pipeline's versions and in-flight microbatches, already serialized (a copy) by its state_dict
    versions = state.weight_versions.state_dict() if state.weight_versions is not None else {}
    feedback = state.wire_feedback.state_dict() if state.wire_feedback is not None else {}
    outer = state.outer.host_copy() if state.outer is not None else {}  # dp_sync diloco's theta_outer, momentum
    return {"model": model, "buffers": buffers, "optim": optim, "progress": copy.deepcopy(state.progress_state()),
            "weight_versions": versions, "wire_feedback": feedback, "diloco": outer, "masters": masters}


def restore(state: TrainState, snap: dict) -> None:
    """Copy a snapshot taken at this grid position back into ``state``'s shards, bit for bit.

    A parameter the snapshot holds no optimizer state for (a snapshot taken before the first step) loses the
    state it gained since, so its next step starts the moments afresh as the snapshotted run did; a NaN step's
    poisoned moments would otherwise survive the rollback and poison every retry. A compressed snapshot is
    unpacked first.
    """
    snap = lossless.unpack(snap)
    with torch.no_grad(), state.resident():
        for named, stepped, opt in state.named_parts():
            for name, p in named:
                _local(p).copy_(snap["model"][name])
            for name, p in stepped:
                if name in snap.get("masters", {}):
                    _local(p).copy_(snap["masters"][name])
                if name in snap["optim"]:
                    opt.state[p] = {k: _like(p, v) for k, v in snap["optim"][name].items()}
                else:
                    opt.state.pop(p, None)
        for name, b in _persistent_buffers(state):
            _local(b).copy_(snap["buffers"][name])
    state.load_progress_state(snap["progress"])
    state.load_weight_versions(snap.get("weight_versions", {}))
    if state.wire_feedback is not None:
        state.wire_feedback.load_state_dict(snap.get("wire_feedback", {}))
    if state.outer is not None:
        state.outer.load_state_dict(snap["diloco"])


def restore_progress(state: TrainState, snap: dict) -> None:
    """Only what a step moves before its update, back from a snapshot of the step boundary it began at: the
    persistent buffers (a forward may move them) and the progress (step, data cursor, LR schedule, loss scale).

    For a rank whose failed step never reached an optimizer (``RankWorker._roll_back_kept``): its weights and
    optimizer state are still the snapshot's, so copying them back (the bulk of a snapshot) would change nothing.
    Only those two entries of a compressed snapshot are unpacked."""
    snap = lossless.unpack({"buffers": snap["buffers"], "progress": snap["progress"]})
    with torch.no_grad(), state.resident():
        for name, b in _persistent_buffers(state):
            _local(b).copy_(snap["buffers"][name])
    state.load_progress_state(snap["progress"])


def _like(param: torch.Tensor, saved):
    """Optimizer state shaped like the parameter becomes a tensor placed like it, in the dtype it was saved in
    (an offloaded optimizer's fp32 moments of a bf16 parameter); scalars stay as saved."""
    if not torch.is_tensor(saved):
        return saved
    if saved.shape == _local(param).shape and saved.dim() > 0:
        state = torch.zeros_like(param, dtype=saved.dtype)
        _local(state).copy_(saved)
        return state
    return saved.clone()
