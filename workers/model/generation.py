"""Text from a trained model: key/value-cached decoding and sampling (``raymesh generate``).

The cache enters the model through the seam context parallelism already uses (``workers.parallel.
context_layout``): every module with a ``context_shard`` attribute is handed an object with ``positions`` and
``attend``. Here the root's object gives the positions of the tokens fed this call (so learned embeddings and
rotary angles continue where the cached ones stopped), and each attention core's keeps that layer's keys and
values and attends the new queries over all of them. The model code is unchanged: the same forward trains,
evaluates and decodes, so what is sampled is what was trained.

Ours rather than ``transformers``' ``generate``: that one runs only Hugging Face model classes, and raymesh's
GPT family has none; for a Llama, the tests hold our greedy decoding to ``LlamaForCausalLM.generate``'s.

The model never sees more than ``model.seq_len`` tokens (positions it was not trained on would mean
nothing, and learned position tables end there): when the window is full the cache is dropped and the newest
``keep`` tokens are encoded again as a fresh prefix, so text can run on past the window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits.

    ``temperature`` 0 is greedy (argmax); otherwise logits are divided by it, then only the ``top_k`` most likely
    ids (0: all) and the smallest set of most likely ids whose probabilities reach ``top_p`` (1: all) may be drawn.
    ``vocab`` ids below it may be drawn (the head may be padded past the tokenizer's vocabulary); ``stop`` ends a
    sample when drawn (the end-of-document id), ``None`` never."""

    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 1.0
    vocab: int | None = None
    stop: int | None = None
    seed: int = 0


class _Positions:
    """The decode state every layer shares: how many tokens are cached, and this call's positions after them."""

    def __init__(self) -> None:
        self.offset = 0

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        return torch.arange(self.offset, self.offset + local_len, device=device)


def prefix_mask(new: int, total: int, device: torch.device) -> torch.Tensor | None:
    """Which of ``total`` keys each of the ``new`` last queries sees: every cached one and the new ones up to its own
    position (None for one query, which sees them all)."""
    if new == 1:
        return None
    return torch.arange(total, device=device)[None, :] <= torch.arange(total - new, total, device=device)[:, None]


class _LayerCache:
    """One attention core's keys and values so far ([batch, kv_heads, cached, head_dim]); or, for an attention that
    caches another form (MLA's compressed latent and rotary key, ``extend``), those tensors."""

    def __init__(self, shared: _Positions) -> None:
        self.shared = shared
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.kept: tuple[torch.Tensor, ...] = ()

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        return self.shared.positions(local_len, device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The new queries over every cached key and the new ones, each query seeing keys up to its own position."""
        self.k = k if self.k is None else torch.cat((self.k, k), dim=2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=2)
        mask = prefix_mask(q.shape[2], self.k.shape[2], q.device)
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask,
                                              enable_gqa=self.k.shape[1] != q.shape[1])

    def extend(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append this call's per-token tensors ([batch, tokens, ...] each) to the cached ones; returns all so far."""
        self.kept = new if not self.kept else tuple(torch.cat(pair, dim=1) for pair in zip(self.kept, new, strict=True))
        return self.kept

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, *self.kept) if t is not None)


class KVCache:
    """Cached decoding of ``model`` (a whole GPT-family model): ``forward(ids)`` feeds the next tokens and returns
    their logits; ``reset()`` forgets them. Installed on the model's ``context_shard`` seam while in use."""

    def __init__(self, model: nn.Module) -> None:
        seams = [m for m in model.modules() if hasattr(m, "context_shard")]
        if any(m.context_shard is not None for m in seams):
            raise ValueError("the model already has a context shard (context parallelism); decode a whole model")
        self.model, self.seams = model, seams
        self.reset()

    def reset(self) -> None:
        self.shared = _Positions()
        for module in self.seams:
            module.context_shard = self.shared if module is self.model else _LayerCache(self.shared)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(ids)
        self.shared.offset += ids.shape[1]
        return logits

    @property
    def length(self) -> int:
        return self.shared.offset

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds over all layers (what decoding keeps per token, times the tokens and batch)."""
        return sum(m.context_shard.nbytes for m in self.seams if isinstance(m.context_shard, _LayerCache))

    def close(self) -> None:
        for module in self.seams:
            module.context_shard = None


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Each row's next id ([batch]) from its last-position logits ([batch, vocab])."""
    logits = logits.float()
    if sampling.vocab is not None:
        logits = logits[:, : sampling.vocab]
    if sampling.temperature == 0:
        return logits.argmax(-1)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        logits = _nucleus(logits, sampling.top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` with every id outside the smallest most-likely set whose probability reaches ``top_p`` masked
    (the most likely id always stays)."""
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = ordered.softmax(-1)
    ranked_above = probs.cumsum(-1) - probs  # the probability of the ids ranked above each one
    dropped = torch.empty_like(order, dtype=torch.bool).scatter_(-1, order, ranked_above >= top_p)
    return logits.masked_fill(dropped, float("-inf"))


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], max_new: int, sampling: Sampling, *, window: int,
             samples: int = 1, keep: int | None = None,
             on_token: Callable[[torch.Tensor], None] | None = None) -> list[list[int]]:
    """``samples`` continuations of ``prompt`` (ids, at least one), each up to ``max_new`` ids and ending early at
    ``sampling.stop`` (which is kept); ``on_token`` sees each step's ids [samples].

    ``window`` is the most tokens the model attends over (``model.seq_len``); when the cache holds that many,
    it is rebuilt from the newest ``keep`` (default ``window // 2``)."""
    if not 0 < len(prompt) < window:
        raise ValueError(f"the prompt has {len(prompt)} tokens; it needs between 1 and {window - 1} (model.seq_len "
                         f"{window} less one for the first new token)")
    keep = window // 2 if keep is None else keep
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    context = torch.tensor([prompt] * samples, device=device)
    was_training = model.training
    model.eval()
    cache = KVCache(model)
    try:
        logits = cache.forward(context)
        out = _decode(cache, context, logits, max_new, sampling, generator, window, keep, on_token)
    finally:
        cache.close()
        model.train(was_training)
    return out


def _decode(cache: KVCache, context: torch.Tensor, logits: torch.Tensor, max_new: int, sampling: Sampling,
            generator: torch.Generator, window: int, keep: int, on_token) -> list[list[int]]:
    """The sampling loop of ``generate`` after its first forward over the prompt."""
    done = torch.zeros(context.shape[0], dtype=torch.bool, device=context.device)
    new: list[torch.Tensor] = []
    for _ in range(max_new):
        ids = next_token(logits[:, -1], sampling, generator)
        new.append(ids)
        if on_token is not None:
            on_token(ids)
        if sampling.stop is not None:
            done |= ids == sampling.stop
        if bool(done.all()) or len(new) == max_new:
            break
        context = torch.cat((context, ids[:, None]), dim=1)
        if cache.length == window:  # full: start again from the newest `keep` tokens
            cache.reset()
            logits = cache.forward(context[:, -keep:])
        else:
            logits = cache.forward(ids[:, None])
    return [_until_stop(row, sampling.stop) for row in torch.stack(new, dim=1).tolist()]


def _until_stop(row: list[int], stop: int | None) -> list[int]:
    """``row`` up to and including its first ``stop`` id."""
    return row[: row.index(stop) + 1] if stop is not None and stop in row else row
