"""Document masking (``model.attention_mask: document``): a token attends only to earlier tokens of its own
document, as Llama 3 trained and torchtitan offers (``attn_mask_type: block_causal``).

A window is a slice of a stream of documents joined by the tokenizer's end-of-document id, which
``workers.data.prepare`` writes before every document after the first. A token's document is the running count of
that id in the window (``workers.data.loader.document_ids``): the id itself opens the next document, so the last
token of a document still learns to predict it.

The ids reach attention from outside the model, the way a context shard does: while one microbatch runs forward
(and backward: recompute replays the forward inside it) its ``Documents`` sits on every attention core
(``attending``). The trainer sets it per microbatch, a pipeline stage per schedule chunk
(``workers.parallel.pipeline.TimedStage``), so stages that receive activations rather than tokens mask the same
way. A model used without it (generation, a causal job) attends causally.

The mask is a boolean ``[batch, 1, q, k]`` tensor for ``F.scaled_dot_product_attention``, which takes one on CPU
and CUDA alike. It costs q x k bytes per microbatch, built once and shared by every layer. FlexAttention's block
mask (``torch.nn.attention.flex_attention``), which skips whole masked tiles on the GPU, is the faster path,
left for later.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def document_mask(documents: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, len(q_pos), len(k_pos)]`` bool, True where the query at global position ``q_pos[i]`` may see
    the key at ``k_pos[j]``: an earlier (or the same) position of the same document. ``documents`` [batch, seq]
    holds the whole window's document ids, indexed by global position."""
    same = documents[:, q_pos, None] == documents[:, None, k_pos]
    return (same & (q_pos[:, None] >= k_pos[None, :]))[:, None]


class Documents:
    """One microbatch's document ids [batch, seq] over the whole window (global positions, whatever share of
    the sequence a context-parallel rank holds), and the masks built from them.

    Why a class: SDPA saves its mask for backward, so a mask built by each layer would be kept once per layer;
    built here once per (query, key) layout, every layer's attention shares the one tensor.
    """

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self._masks: dict[str, torch.Tensor] = {}

    def mask(self, layout: str, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """``document_mask`` for queries ``q_pos`` over keys ``k_pos``, built on the first call for ``layout`` (a
        name for that pair of positions, which every layer of a rank uses alike)."""
        if layout not in self._masks:
            self._masks[layout] = document_mask(self.ids, q_pos, k_pos)
        return self._masks[layout]

    def whole(self, seq: int, device: torch.device) -> torch.Tensor:
        """The mask of a whole ``seq``-token window over itself, in natural order."""
        pos = torch.arange(seq, device=device)
        return self.mask("whole", pos, pos)


def split_documents(ids: torch.Tensor | None, chunks: int, device: torch.device) -> list[Documents | None]:
    """``ids`` [batch, seq] cut into ``chunks`` microbatches along the batch (as the inputs are), on ``device``;
    ``chunks`` Nones when the job masks causally (``ids`` None)."""
    if ids is None:
        return [None] * chunks
    return [Documents(part.to(device)) for part in ids.chunk(chunks)]


def attention_cores(module: nn.Module) -> list[nn.Module]:
    """The attention cores (``workers.model.gpt.CausalCore`` and its subclasses) inside ``module``."""
    from workers.model.gpt import CausalCore  # gpt imports this module for the mask

    return [m for m in module.modules() if isinstance(m, CausalCore)]


@contextlib.contextmanager
def attending(modules: list[nn.Module], documents: Documents | None):
    """Every attention core inside ``modules`` masks by ``documents`` for the block (a forward, or a backward
    that recomputes one), then causally again; with None, nothing changes."""
    if documents is None:
        yield
        return
    cores = [core for module in modules for core in attention_cores(module)]
    for core in cores:
        core.documents = documents
    try:
        yield
    finally:
        for core in cores:
            core.documents = None
