"""The gradient noise scale, measured: how large a batch pays (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training"; seed 002 lines 179-184: the batch size is a resource, and past the critical batch size
more samples per step buy little).

B_simple = tr(Σ) / |G|², Σ the per-example gradient covariance and G the true gradient, predicts the critical
batch size. Neither is observed, but the squared norm of a batch-B gradient has expectation |G|² + tr(Σ)/B, so
the norms of one small-batch (B_s) and one large-batch (B_b) gradient give unbiased estimates of both (the paper's
appendix A.1):

    |G|² ≈ (B_b |G_b|² - B_s |G_s|²) / (B_b - B_s)        tr(Σ) ≈ (|G_s|² - |G_b|²) / (1/B_s - 1/B_b)

Each is averaged over several measurements before the ratio is taken (a ratio of noisy estimates is biased).
Data parallelism measures both at once: a rank's share of the global batch is the small batch, the global batch
(the mean of the shares' gradients) the large one. ``measure`` does exactly that in one process on the job's own
model and data, at its starting weights (``model.init_from``'s for a fine-tune); ``raymesh plan --noise-scale N``
reports it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NoiseScale:
    """The two estimates and their ratio, B_simple (in sequences: the batches here are counted in sequences)."""

    b_small: int
    b_big: int
    grad_sq: float  # |G|², the true gradient's squared norm
    trace: float  # tr(Σ), the per-sequence gradient variance summed over parameters

    @property
    def b_simple(self) -> float:
        """tr(Σ)/|G|²; infinite when the measured |G|² is not positive (noise swamps the signal: any batch pays)."""
        return self.trace / self.grad_sq if self.grad_sq > 0 else float("inf")

    def advice(self, global_batch: int) -> str:
        """What ``train.global_batch_size`` is against the critical batch size B_simple predicts."""
        b = self.b_simple
        where = ("below it: a larger batch (more data-parallel ranks) still shortens training nearly in proportion"
                 if global_batch < b / 2 else "above it: more sequences per step buy little, the steps are what "
                 "count" if global_batch > 2 * b else "near it: the usual balance of steps and compute")
        return (f"gradient noise scale B_simple = tr(Σ)/|G|² = {b:,.1f} sequences (|G|² {self.grad_sq:.4g}, tr(Σ) "
                f"{self.trace:.4g}, from batches of {self.b_small} and {self.b_big}); train.global_batch_size "
                f"{global_batch} is {where}")


def estimate(b_small: int, b_big: int, small_sq: Sequence[float], big_sq: Sequence[float]) -> NoiseScale:
    """McCandlish et al.'s unbiased |G|² and tr(Σ) from squared gradient norms measured at two batch sizes."""
    if not 0 < b_small < b_big:
        raise ValueError(f"the small batch ({b_small}) must be positive and smaller than the large one ({b_big})")
    s, b = statistics.fmean(small_sq), statistics.fmean(big_sq)
    return NoiseScale(b_small, b_big, grad_sq=(b_big * b - b_small * s) / (b_big - b_small),
                      trace=(s - b) / (1 / b_small - 1 / b_big))


def batch_norms(gradient: Callable, pieces: Sequence) -> tuple[float, float]:
    """Squared gradient norms of one large batch cut into equal ``pieces``: the pieces' mean |G_s|², and |G_b|²
    of their mean gradient (which is the large batch's, the loss being a mean). ``gradient(piece)`` returns the
    piece's gradient as a list of tensors."""
    import torch

    grads = [torch.cat([g.flatten().double() for g in gradient(piece)]) for piece in pieces]
    small = statistics.fmean(float(g.square().sum()) for g in grads)
    return small, float(torch.stack(grads).mean(0).square().sum())


def measure(spec, batches: int) -> NoiseScale:
    """B_simple of the job's model at its starting weights, from its first ``batches`` global batches, each cut
    into the shares the job's data-parallel ranks take (or its microbatches when dp = 1)."""
    import torch
    import torch.nn.functional as F

    from workers.data import DataCursor, TokenDataset
    from workers.model.hf_io import load_hf_weights
    from workers.model.meta_init import build_full
    from workers.model.registry import model_config

    model = build_full(model_config(spec.worker_dict()["model"]), spec.train.seed)
    if spec.model.init_from is not None:
        load_hf_weights(model, spec.model.init_from)
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient(piece):
        inputs, targets = piece
        loss = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten(0, 1))
        return torch.autograd.grad(loss, params)

    share = spec.parallel.dp if spec.parallel.dp > 1 else spec.train.microbatches
    if share < 2:
        raise ValueError("--noise-scale needs two batch sizes: set parallel.dp or train.microbatches above 1 (the "
                         "small batch is one share of the global batch)")
    big = spec.train.global_batch_size
    cursor = DataCursor(TokenDataset(spec.data.path, spec.model.seq_len, spec.data.seed), big, dp_rank=0, dp_size=1)
    small_sq, big_sq = [], []
    for _ in range(batches):
        inputs, targets = cursor.next_batch()
        pieces = list(zip(inputs.chunk(share), targets.chunk(share), strict=True))
        s, b = batch_norms(gradient, pieces)
        small_sq.append(s)
        big_sq.append(b)
    return estimate(big // share, big, small_sq, big_sq)
