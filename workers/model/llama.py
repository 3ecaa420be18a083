"""Llama-family decoder (Llama 2/3 shapes, and Mistral's, Qwen2's and Qwen3's): RMSNorm, rotary positions with
Llama-3 frequency scaling, grouped-query attention and a SwiGLU feed-forward, tied or untied embeddings. The
families' differences are model fields, not a second implementation: ``head_dim`` (heads wider or narrower than
d_model / n_heads, Qwen3), ``qkv_bias`` (Qwen2's q/k/v biases) and ``qk_norm`` (Qwen3's per-head RMSNorm of
queries and keys before rotary).

Laid out like ``workers.model.gpt`` (layers in a ``ModuleDict`` keyed by global index, ends that may be
``None`` on a pipeline stage, attention reshaping with ``-1`` heads), so the GPT's stage cut and blocks
hooks apply unchanged and only the tensor-parallel plan is this family's (``llama_parallel``).

Rotary convention: raymesh's Llama rotates the two *halves* of each head (Hugging Face's ``rotate_half``
layout), not Meta's interleaved pairs. Hugging Face checkpoints are then read and written without
permuting the q/k rows (``workers.model.hf_io``); a Meta-layout checkpoint would need the permutation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.config import ModelConfig
from workers.model.gpt import GPT, CausalCore, RMSNorm, token_positions
from workers.model.moe import MoELayer, share_balance_pool
from workers.model.registry import ModelFamily, register


def rotary_frequencies(cfg: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies of the head's channel pairs, Llama-3-scaled when ``cfg.rope_scaling`` is set.

    Llama 3's rule: wavelengths beyond ``original_max_position_embeddings / low_freq_factor`` are slowed by
    ``factor``, those below ``... / high_freq_factor`` kept, and the band between interpolated smoothly.
    """
    dim = cfg.head_size
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, device=device).float() / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    old = rs.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > old / rs.low_freq_factor, inv_freq / rs.factor, inv_freq)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * slowed / rs.factor + smooth * slowed
    medium = (wavelen >= old / rs.high_freq_factor) & (wavelen <= old / rs.low_freq_factor)
    return torch.where(medium, blended, slowed)


def apply_rotary_halves(x: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [batch, seq, heads, head_dim] by each token's global position, channel i paired with
    i + head_dim/2.

    Tables come from the positions on the fly (as in the GPT), so no stage or TP plan carries a buffer.
    """
    angles = torch.outer(positions.to(torch.float32), inv_freq)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    # in float32 (the tables are): each product promotes its bf16 half, so no float32 copy of x is made first
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).type_as(x)


class GroupedCausalCore(CausalCore):
    """Parameter-free attention core with grouped K/V heads (selective recompute wraps just this; the cp
    kernels take grouped K/V as they are)."""

    def local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1], **self.masking(q))


class GroupedQueryAttention(nn.Module):
    """Q with ``n_heads`` heads, K/V with ``n_kv_heads``; each K/V head serves n_heads / n_kv_heads query heads.
    Heads are counted from the weights' local rows, so a TP shard sees only its own heads. With ``qk_norm``
    each query and key head is RMS-normalised over its ``head_size`` channels (one weight shared by all heads)
    before rotary, as Qwen3 does."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_size
        self.cfg = cfg
        kv_dim = cfg.kv_heads * cfg.head_size
        self.wq = nn.Linear(cfg.d_model, cfg.attention_width, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, kv_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, kv_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.attention_width, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(cfg.head_size, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_size, cfg.norm_eps) if cfg.qk_norm else None
        self.core = GroupedCausalCore(cfg.sliding_window)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rotary_frequencies(self.cfg, x.device)
        positions = token_positions(self.core.context_shard, s, x.device)
        q, k = apply_rotary_halves(q, inv_freq, positions), apply_rotary_halves(k, inv_freq, positions)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: w1 the gate, w3 the up projection, w2 the down projection (Meta's names)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = GroupedQueryAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = MoELayer(cfg, layer, swiglu=True) if cfg.is_moe_layer(layer) else SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(GPT):
    """The Llama decoder. A ``GPT`` subclass for its forward (embed, blocks, norm, head: the same) and so the
    GPT's stage cut applies; ``__init__`` builds Llama parts instead of calling ``GPT.__init__``; a family with
    other blocks of the same outline (gpt-oss) subclasses it naming its ``block``."""

    block = LlamaBlock

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        # padding_idx only stops the lookup's gradient to that row (as in transformers); the ids stay global
        # under a vocab-sharded (TP) embedding, whose DTensor backward is computed in global ids
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model,
                                                                padding_idx=cfg.pad_token_id)
        self.pos_embeddings = None
        self.layers = nn.ModuleDict({str(i): self.block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        share_balance_pool(self)  # model.moe.balance_loss: pooled
        if not self.layers["0"].attention.wq.weight.is_meta:
            self.init_weights()  # GPT's: every parameter from init_parameter, seeded by (seed, name)


register(ModelFamily(
    arch="llama",
    config=ModelConfig,
    build=Llama,
    lora_targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3"),
    recompute_targets={"full": "", "selective": "attention.core"},
    hooks={
        "cut_stage": "workers.parallel.gpt_parallel:cut_stage",
        "tensor_parallel": "workers.parallel.llama_parallel:apply_tensor_parallel",
        "blocks": "workers.parallel.gpt_parallel:blocks",
        "init_parameter": "workers.model.gpt:init_parameter",
    },
))
