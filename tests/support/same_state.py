"""Bit-for-bit comparison of two ranks' states as snapshots hold them (nested dicts and lists of tensors)."""

from __future__ import annotations

import torch


def same_state(a, b) -> bool:
    """``a`` and ``b`` hold the same values, tensor for tensor (bit for bit), in the same structure."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b
