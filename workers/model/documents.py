"""Document masking (``model.attention_mask: document``): a token attends only to earlier tokens of its own
document, as Llama 3 trained and torchtitan offers (``attn_mask_type: block_causal``).

A window is a slice of a stream of documents joined by the tokenizer's end-of-document id, which
``workers.data.prepare`` writes before every document after the first. A token's document is the running count of
that id in the window (``workers.data.loader.document_ids``): the id itself opens the next document, so the last
token of a document still learns to predict it.

The ids reach attention from outside the model, the way a context shard does: while one microbatch runs forward (and
backward: recompute replays the forward inside it) its ``Documents`` sits on every attention core (``attending``),
and on a GPT root with learned positions, which then looks up each token's index within its document rather than in
the window (``Documents.positions``, Megatron's ``--reset-position-ids``): learned positions are absolute, so
without it a document would be seen at its place in the window. The trainer sets it per microbatch, a pipeline stage
per schedule chunk (``workers.parallel.pipeline.TimedStage``), so stages that receive activations rather than tokens
mask the same way. A model used without it (generation, a causal job) attends causally.

Attention runs blockwise (``workers.model.attention_blocks.blockwise_attention`` on one process and under
Ulysses, the ring's and all-gather's tiles under cp), never with a dense ``[batch, 1, q, k]`` mask: each tile of
queries x keys is dropped when no pair in it shares a document, sent whole (or causal, on the diagonal) through the
fused flash kernel when every pair does, and masked by a boolean tile only where a document boundary crosses it.
Those tile masks are built once per microbatch and shared by every layer (``Documents.cached``). ``Documents.mask``
still builds the dense additive mask, for the references and benchmarks that compare against SDPA with it.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn


def document_mask(documents: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, len(q_pos), len(k_pos)]`` bool, True where the query at global position ``q_pos[i]`` may see
    the key at ``k_pos[j]``: an earlier (or the same) position of the same document. ``documents`` [batch, seq]
    holds the whole window's document ids, indexed by global position."""
    same = documents[:, q_pos, None] == documents[:, None, k_pos]
    return (same & (q_pos[:, None] >= k_pos[None, :]))[:, None]


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """[batch, seq]: each token's index within its document, from the document ids [batch, seq] (0 where one
    opens: at its end-of-document id, or at the window's start for one cut by the window)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    opens = torch.ones_like(documents, dtype=torch.bool)
    opens[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(opens, index, 0).cummax(dim=1).values


class Documents:
    """One microbatch's document ids [batch, seq] over the whole window (global positions, whatever share of
    the sequence a context-parallel rank holds), and the masks built from them.

    Why a class: SDPA saves its mask for backward, and given a boolean one it saves the additive copy it makes on
    each call: one ``[batch, 1, q, k]`` float tensor per layer (measured: 4 layers of 2 x 512 x 512 fp32, 8 MiB
    where the whole causal block's activations are 9 MiB). The additive mask is built here once per (query, key)
    layout and dtype, so every layer's attention shares the one tensor.
    """

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self._masks: dict[tuple, object] = {}
        _LIVE[_storage_key(ids)] = self  # ``documents_of`` finds it by its ids for as long as it lives

    def mask(self, layout: str, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``document_mask`` for queries ``q_pos`` over keys ``k_pos`` as SDPA's additive mask in ``dtype`` (0
        where attended, -inf where not), built on the first call for ``layout`` (a name for that pair of
        positions, which every layer of a rank uses alike)."""
        def additive() -> torch.Tensor:
            allowed = document_mask(self.ids, q_pos, k_pos)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
            mask.shared_document_mask = True  # kept as it is by saved-tensor hooks: ``is_shared_mask``
            return mask
        return self.cached((layout, dtype), additive)

    def cached(self, key: tuple, build):
        """``build()``'s result for ``key``, built on the first call: what every layer (and its backward) asks
        alike is built once per microbatch (ring attention's block masks too), then kept until ``release``."""
        if key not in self._masks:
            self._masks[key] = build()
        return self._masks[key]

    def positions(self, window_pos: torch.Tensor) -> torch.Tensor:
        """[batch, len(window_pos)]: the index within its document of the token at each window position
        ``window_pos`` (a context-parallel rank's share, or the whole window), what learned positions look up."""
        return self.cached(("positions",), lambda: document_positions(self.ids))[:, window_pos]

    def whole(self, q: torch.Tensor) -> torch.Tensor:
        """The mask of a whole window over itself, in natural order, for queries ``q`` [batch, heads, seq, dim]."""
        pos = torch.arange(q.shape[2], device=q.device)
        return self.mask("whole", pos, pos, q.dtype)

    def release(self) -> None:
        """Forget the masks built: those a graph saved live on in it until its backward, and no more than the
        microbatches in flight are kept (a step's list of ``Documents`` would otherwise hold every one's)."""
        self._masks.clear()


_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # ids' storage -> the Documents holding them


def _storage_key(t: torch.Tensor) -> tuple:
    """What identifies a tensor's data while it lives: where it starts, its shape, strides, dtype and device (a
    ``Documents`` holds its ids, so they cannot be freed and their address reused while it lives)."""
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, str(t.device)


def documents_of(ids: torch.Tensor | None) -> Documents | None:
    """The live ``Documents`` over ``ids`` (so every layer's attention operator, which is handed the ids tensor
    alone, shares its mask cache: ``workers.model.attention_ops``), else a new one over them."""
    if ids is None:
        return None
    found = _LIVE.get(_storage_key(ids))
    return found if found is not None else Documents(ids)


def is_shared_mask(t: torch.Tensor) -> bool:
    """Whether ``t`` is (a view of) an additive mask ``Documents.mask`` built. Saved-tensor hooks
    (``workers.offload.activations``) keep it as it is: every layer saves the one tensor, so a packed copy per
    layer would undo the sharing, and its -inf cannot be rounded (fp8 e4m3 has no infinity: a compressed mask
    came back NaN, and so did every gradient)."""
    return getattr(t, "shared_document_mask", False) or getattr(t._base, "shared_document_mask", False)


def split_documents(ids: torch.Tensor | None, chunks: int, device: torch.device) -> list[Documents | None]:
    """``ids`` [batch, seq] cut into ``chunks`` microbatches along the batch (as the inputs are), on ``device``;
    ``chunks`` Nones when the job masks causally (``ids`` None)."""
    if ids is None:
        return [None] * chunks
    return [Documents(part.to(device)) for part in ids.chunk(chunks)]


def document_readers(module: nn.Module) -> list[nn.Module]:
    """The modules inside ``module`` that read a microbatch's documents, each saying so by ``reads_documents``: the
    attention cores (``workers.model.gpt.CausalCore`` and its subclasses: the mask) and a GPT root holding learned
    position embeddings (each token's position within its document)."""
    return [m for m in module.modules() if getattr(m, "reads_documents", False)]


@contextlib.contextmanager
def attending(modules: list[nn.Module], documents: Documents | None):
    """Every attention core inside ``modules`` masks by ``documents`` for the block (a forward, or a backward
    that recomputes one), and learned positions restart at each document, then causally and by window position
    again, the masks built for it released; with None, nothing changes."""
    if documents is None:
        yield
        return
    readers = [reader for module in modules for reader in document_readers(module)]
    for reader in readers:
        reader.documents = documents
    try:
        yield
    finally:
        for reader in readers:
            reader.documents = None
        documents.release()
