"""A small GPT config and random token batches for memory tests that need no data file."""

from __future__ import annotations

import torch

SMALL_MODEL = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 128, "seq_len": 32,
               "positions": "learned", "norm_eps": 1e-5, "init_std": 0.02}


def random_batch(seed: int):
    """(inputs, targets) of 4 random byte sequences; the same seed gives the same batch."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (4, 33), generator=g)
    return tokens[:, :-1], tokens[:, 1:]
