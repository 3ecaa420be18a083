"""Compression's per-rank state under ZeRO-0 (PowerSGD's and top-k's error feedback, PowerSGD's warm-started
Q and its generator; 1-bit Adam's error), carried by in-memory snapshots and DCP checkpoints so that a recovered
or resumed run continues bit-identically instead of restarting the feedback at zero.

Each rank's state is its own (it differs across data-parallel ranks and belongs to its own buckets), so a
checkpoint keeps it as one opaque entry per rank, named by the layout and the rank: DCP stores a ``BytesIO``
value as is, and a checkpoint resumed at another layout finds no entry and starts the feedback at zero, as a
fresh run does (the buckets differ there anyway).
"""

from __future__ import annotations

import io

import torch


class CompressionFeedback:
    """The state of one rank's ``holders`` (one per stage module: its ``GradBuckets``' hook, or its 1-bit Adam's
    ``feedback``; each with ``state_dict()`` and ``load_state_dict(state, device)``), in
    ``TrainState.wire_feedback``'s interface: ``state_dict``/``load_state_dict`` for snapshots,
    ``dcp_state``/``load_dcp_state`` for checkpoints."""

    def __init__(self, holders: list, layout: str, rank: int, device: torch.device):
        self.holders = holders
        self.key = f"grad_compression/{layout}/rank{rank}"
        self.device = device

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{i}/{k}": t for i, holder in enumerate(self.holders) for k, t in holder.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for i, holder in enumerate(self.holders):
            holder.load_state_dict(_part(state, i), self.device)

    def _upgraded(self, state: dict[str, torch.Tensor], checkpoint: str, saved_decay: dict[str, float]) -> dict:
        """``state`` with each part keyed as its holder now keys it: a holder whose keys changed (1-bit Adam's,
        from positions to names) reads an older save's through its ``upgrade``, or refuses it."""
        out = {}
        for i, holder in enumerate(self.holders):
            part = _part(state, i)
            if hasattr(holder, "upgrade"):
                part = holder.upgrade(part, saved_decay, checkpoint)
            out.update({f"{i}/{k}": t for k, t in part.items()})
        return out

    def dcp_state(self, template: bool = False) -> dict[str, io.BytesIO]:
        """This rank's state as one DCP bytes entry; ``template``: an empty one for DCP to fill on load."""
        blob = io.BytesIO()
        if not template:
            torch.save(self.state_dict(), blob)
            blob.seek(0)
        return {self.key: blob}

    def load_dcp_state(self, loaded: dict[str, io.BytesIO], checkpoint: str = "",
                       saved_decay: dict[str, float] | None = None) -> bool:
        """Take what DCP filled in from ``checkpoint``; an entry left empty (another layout, an older run) means
        zero feedback. ``saved_decay``: each parameter's weight decay in the checkpoint's optimizer
        (``saved_decays``), by which an older save's position-keyed state is read. Returns whether it was taken."""
        blob = loaded.get(self.key)
        found = blob is not None and blob.getbuffer().nbytes > 0
        if found:
            blob.seek(0)
        state = torch.load(blob, weights_only=True) if found else {}
        self.load_state_dict(self._upgraded(state, checkpoint, saved_decay or {}))
        return found


def _part(state: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Holder ``i``'s entries of a ``CompressionFeedback`` state, without their ``i/`` prefix."""
    prefix = f"{i}/"
    return {k.removeprefix(prefix): t for k, t in state.items() if k.startswith(prefix)}


def saved_decays(optim: dict) -> dict[str, float]:
    """Each parameter's weight decay as a loaded checkpoint's optimizer held it (DCP's flattened
    ``param_groups.<name>.weight_decay`` entries): which param group it was in when it was saved."""
    head, tail = "param_groups.", ".weight_decay"
    return {k[len(head):-len(tail)]: v for k, v in optim.items() if k.startswith(head) and k.endswith(tail)}
