"""The order of a weighted data mixture (`data.mix`): which source each stream position draws from.

Why this rule: the global order must depend only on the position (never on the data-parallel layout, so ranks take
contiguous slices and a checkpoint's `position` alone resumes it), and a resume at step 10^6 must not replay 10^9
choices. Megatron-Core's greedy blend (the source whose ``weight * (i + 1) - count`` is largest) is sequential;
this is its closed-form cousin, the Sainte-Laguë (Webster) divisor order: source ``j``'s ``m``-th sample has the
key ``(m + 1/2) / w_j`` and the stream is every source's keys merged in increasing order (ties to the lower
source). A source's count after ``n`` samples is then within one of ``w_j * n`` for two sources (it is rounding)
and three (measured over thousands of random weights), as Megatron's; a sample or two off with more (so is
Megatron's greedy rule past five), and the first ``n`` positions are found by arithmetic plus a merge of
a few keys, vectorised with numpy. Torch-free: the controller imports it to report each source's share.
"""

from __future__ import annotations

import numpy as np


def normalised(weights: list[float]) -> np.ndarray:
    """The weights as shares summing to one (a job file's weights need not). Weights near float's limit (`1e308`
    twice) sum to inf, which would leave every share 0: those are scaled by the largest first (only those, so the
    shares of other weights, which a checkpoint's data position is fingerprinted by, stay bit for bit)."""
    w = np.asarray(weights, dtype=np.float64)
    with np.errstate(over="ignore"):  # the overflow is what this looks for
        overflows = not np.isfinite(w.sum())
    if overflows:
        w = w / w.max()
    return w / w.sum()


def _merge(shares: np.ndarray, done: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The next ``count`` (source, index within the source) after ``done[j]`` samples of each source ``j`` (a
    prefix of the order): each source's next ``count`` keys, merged."""
    ahead = np.arange(count, dtype=np.int64)
    index = done[:, None] + ahead[None, :]  # [sources, count]
    keys = (index + 0.5) / shares[:, None]
    source = np.broadcast_to(np.arange(len(shares))[:, None], index.shape)
    first = np.lexsort((source.ravel(), keys.ravel()))[:count]
    return source.ravel()[first], index.ravel()[first]


def counts(shares: np.ndarray, n: int) -> np.ndarray:
    """int64 [sources]: how many of the first ``n`` positions each source supplies. A safe lower bound (each
    source's quota less one more than the number of sources: the order falls short of a quota by a sample or two)
    and then a merge of the few keys left, so the work does not grow with ``n``."""
    done = np.maximum(np.floor(shares * n).astype(np.int64) - len(shares) - 1, 0)
    rest = n - int(done.sum())
    source, _ = _merge(shares, done, rest)
    return done + np.bincount(source, minlength=len(shares))


def take(shares: np.ndarray, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions [start, start + count): int64 arrays of their source and their index within that source's own
    stream (its epochs, in its own order)."""
    if start < 0 or count < 0:
        raise ValueError(f"start and count must be non-negative, got {start}, {count}")
    return _merge(shares, counts(shares, start), count)
