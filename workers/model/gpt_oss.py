"""gpt-oss (``model.arch: gpt_oss``, OpenAI 2025): a Llama-shaped decoder whose attention layers alternate between a
sliding window and the whole causal prefix (``layer_types``), with a learned sink logit per head, q/k/v/o biases
and YaRN rotary positions, and a mixture of experts in every block: a biased linear router taking the top k
logits and a softmax over them, experts with biases and a clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``, the
up projection plus one). Hugging Face ``GptOssForCausalLM`` weights in and out (``hf_reads``, ``to_hf_state``,
``config_fields``, ``hf_config``).

Attention sinks (``SinkCore``): softmax over a row's keys and one extra logit per head whose value vector is
zero, i.e. the attention output scaled by sigmoid(lse - sink). It runs through the blockwise attention
(``workers.model.attention_blocks``), whose online softmax starts each row from the sink, so windows, document
masks and the sink compose exactly and no ``[S, S]`` mask is built. Under context parallelism the sinks go to the
``cp_impl`` kernel as they are (ring and all-gather start every rank's running softmax from them; Ulysses deals them
out with the query heads); tensor parallelism shards the sinks with their heads
(``workers.parallel.gpt_oss_parallel``).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from workers.model.attention_blocks import blockwise_attention
from workers.model.config import LAYER_TYPES, ModelConfig, YarnScaling
from workers.model.gpt import RMSNorm, token_positions
from workers.model.gpt import init_parameter as gpt_init_parameter
from workers.model.llama import GroupedCausalCore, Llama, apply_rotary_halves
from workers.model.moe import Experts, MoELayer, Router, Routing, _dropout
from workers.model.names import mapped_name
from workers.model.registry import ModelFamily, register

# -- rotary positions -------------------------------------------------------------------------------------------


def yarn_frequencies(dim: int, theta: float, yarn: YarnScaling | None,
                     device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies of the ``dim`` channels' pairs, the factor rotated q and k are scaled by): plain rotary
    at ``theta`` without ``yarn``; with it, transformers' ``_compute_yarn_parameters`` rule (module docstring of
    ``YarnScaling``)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if yarn is None:
        return inv_freq, 1.0

    def turns(rotations: float) -> float:  # the pair index whose wavelength fits ``rotations`` turns in the context
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turns(yarn.beta_fast), turns(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: the pair keeps its frequency (short wavelengths), 0: interpolated
    inv_freq = inv_freq / yarn.factor * (1 - kept) + inv_freq * kept
    return inv_freq, (0.1 * math.log(yarn.factor) + 1.0 if yarn.factor > 1 else 1.0)


# -- attention ----------------------------------------------------------------------------------------------------

class HeadSinks(nn.Module):
    """One learned sink logit per query head (``weight`` [n_heads]); under tensor parallelism a DTensor sharded
    with the heads, of which ``local`` hands the attention its own."""

    def __init__(self, heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(heads))

    def local(self) -> torch.Tensor:
        return self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight


class SinkCore(GroupedCausalCore):
    """The attention core with sinks: the blockwise path (``blockwise_attention``), or the context-parallel kernel
    under cp, whose running softmax starts from each head's sink; the layer's window (None for a full-attention
    layer) and the document mask apply as on every other family."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        if self.context_shard is not None:
            return self.context_shard.attend(q, k, v, sinks=sinks, **self.document_kwargs())
        return blockwise_attention(q, k, v, self.documents, self.window, sinks)


class SinkAttention(nn.Module):
    """Grouped-query attention with q/k/v/o biases, YaRN rotary on head halves, a per-layer window and sinks."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.head_dim = cfg, cfg.head_size
        kv = cfg.kv_heads * cfg.head_size
        self.wq = nn.Linear(cfg.d_model, cfg.attention_width)
        self.wk = nn.Linear(cfg.d_model, kv)
        self.wv = nn.Linear(cfg.d_model, kv)
        self.wo = nn.Linear(cfg.attention_width, cfg.d_model)
        self.sinks = HeadSinks(cfg.n_heads)
        self.core = SinkCore(cfg.layer_window(layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        inv_freq, scale = yarn_frequencies(self.head_dim, self.cfg.rope_theta, self.cfg.rope_yarn, x.device)
        positions = token_positions(self.core.context_shard, s, x.device)
        q, k = (apply_rotary_halves(t, inv_freq, positions) for t in (q, k))
        if scale != 1.0:
            q, k = q * scale, k * scale
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.sinks.local())
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


# -- mixture of experts -------------------------------------------------------------------------------------------

class ClampedExperts(Experts):
    """gpt-oss's experts: biases beside each stacked matrix (``b1``, ``b3`` [E, h], ``b2`` [E, d]) and the clamped
    SwiGLU ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``, g = min(gate, limit). Stacked on dim 0 like the
    matrices, so expert parallelism and meta-device init cut them with their experts."""

    grouped_gemm = False  # the fused grouped GEMMs compute the plain SwiGLU without biases

    def __init__(self, cfg: ModelConfig):
        moe = cfg.moe
        hidden = moe.d_expert or cfg.ffn_dim
        super().__init__(moe.experts, cfg.d_model, hidden, swiglu=True, dropout=moe.expert_dropout)
        self.b1 = nn.Parameter(torch.zeros(moe.experts, hidden))
        self.b3 = nn.Parameter(torch.zeros(moe.experts, hidden))
        self.b2 = nn.Parameter(torch.zeros(moe.experts, cfg.d_model))
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def one(self, j: int, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        gate = (x @ self.w1[j] + self.b1[j]).clamp(max=self.limit)
        up = (x @ self.w3[j] + self.b3[j]).clamp(-self.limit, self.limit)
        hidden = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        return _dropout(hidden, self.dropout, self.training, keys) @ self.w2[j] + self.b2[j]


class BiasedTopKRouter(Router):
    """gpt-oss's router: logits x W^T + b, the top k of them per token, their softmax the gates (the softmax over
    all experts renormalised over the chosen ones: the same numbers); the balance loss as router topk's."""

    def __init__(self, cfg, d_model: int):
        super().__init__(cfg, d_model)
        self.bias = nn.Parameter(torch.zeros(cfg.experts))

    def logits(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return super().logits(x, weight) + self.bias.float()

    def decide(self, x: torch.Tensor, logits: torch.Tensor, noise) -> Routing:
        top, choices = logits.topk(self.cfg.k, -1)
        return self.balanced(logits.softmax(-1), choices, top.softmax(-1))


class GptOssMoE(MoELayer):
    """The MoE feed-forward with gpt-oss's router and experts (dispatch, expert parallelism, losses: MoELayer's)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer, swiglu=True)
        self.router = BiasedTopKRouter(cfg.moe, cfg.d_model)
        self.experts = ClampedExperts(cfg)


class GptOssBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = SinkAttention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = GptOssMoE(cfg, layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GptOss(Llama):
    """The gpt-oss decoder: Llama's outline (embedding with ``pad_token_id``, blocks, norm, head, tied or not) over
    ``GptOssBlock``s."""

    block = GptOssBlock


def init_parameter(name: str, shape: tuple, generator: torch.Generator, cfg: ModelConfig) -> torch.Tensor:
    """The GPT's rule (``workers.model.gpt.init_parameter``), but every bias and the sinks at zero (the experts'
    and the router's biases included, which the MoE rule would draw)."""
    if re.search(r"\.(b[123]|bias|sinks\.weight)$", name):
        return torch.zeros(shape)
    return gpt_init_parameter(name, shape, generator, cfg)


# -- Hugging Face GptOssForCausalLM --------------------------------------------------------------------------------

_ENDS = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
         "output.weight": "lm_head.weight"}
_LAYER = {**{f"attention.w{x}.{kind}": f"self_attn.{x}_proj.{kind}" for x in "qkvo" for kind in ("weight", "bias")},
          "attention.sinks.weight": "self_attn.sinks", "attention_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight", "feed_forward.router.weight": "mlp.router.weight",
          "feed_forward.router.bias": "mlp.router.bias"}
# an expert stack -> (its Hugging Face tensor, which half of the interleaved gate/up columns: 0 gate, 1 up, None whole)
_EXPERTS = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None),
            "b1": ("gate_up_proj_bias", 0), "b3": ("gate_up_proj_bias", 1), "b2": ("down_proj_bias", None)}
_STACK = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123]|b[123])")


def hf_name(name: str) -> str:
    """The Hugging Face name of raymesh gpt-oss tensor ``name`` (an expert stack: the fused tensor it is part of)."""
    m = _STACK.fullmatch(name)
    if m is not None:
        return f"model.layers.{m.group(1)}.mlp.experts.{_EXPERTS[m.group(2)][0]}"
    return mapped_name(name, _ENDS, _LAYER, "GptOss")


def disk_shape(name: str, experts: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The on-disk shape of expert stack ``name`` whose full stack is [experts, *shape[1:]]: gate and up
    interleaved in one tensor of twice their columns."""
    half = _EXPERTS[_STACK.fullmatch(name).group(2)][1]
    rest = list(shape[1:])
    if half is not None:
        rest[-1] *= 2
    return (experts, *rest)


def from_disk(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Expert stack ``name``'s values out of its fused Hugging Face tensor (gate: even columns, up: odd)."""
    half = _EXPERTS[_STACK.fullmatch(name).group(2)][1]
    return tensor if half is None else tensor[..., half::2]


def hf_reads(model: nn.Module, reader, plain_name, local_box):
    """(Hugging Face name, the tensor it fills, a call reading its values) for each of ``model``'s parameters
    (a whole model or one rank's cut, sharded stage): a DTensor its own box; an expert stack only the experts
    this rank keeps (``Experts.first`` on), de-interleaved from the fused gate/up tensor."""
    firsts = {f"{prefix}.{n}": (m.first, m.num_experts) for prefix, m in model.named_modules()
              if isinstance(m, Experts) for n, _ in m.named_parameters(recurse=False)}
    for name, param in model.named_parameters():
        plain, (local, box) = plain_name(name), local_box(param)
        key = hf_name(plain)
        if name not in firsts:
            source = reader.slice(key, name, param.shape)
            yield key, local, lambda source=source, box=tuple(box): source[box]
            continue
        first, experts = firsts[name]
        source = reader.slice(key, name, disk_shape(plain, experts, tuple(param.shape)))
        rows = slice(first + box[0].start, first + box[0].stop)
        yield key, local, lambda source=source, rows=rows, plain=plain, box=tuple(box[1:]): (
            from_disk(plain, source[rows])[(slice(None), *box)])


def to_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full raymesh gpt-oss state dict as the tensors ``GptOssForCausalLM.save_pretrained`` writes: each layer's
    gate and up stacks (and their biases) interleaved into one fused tensor, the rest renamed."""
    out = {}
    for name, value in state.items():
        m = _STACK.fullmatch(name)
        if m is None:
            out[hf_name(name)] = value.contiguous()
            continue
        half = _EXPERTS[m.group(2)][1]
        if half is None:
            out[hf_name(name)] = value.contiguous()
        elif half == 0:
            up = state[name.replace(".w1", ".w3").replace(".b1", ".b3")]
            out[hf_name(name)] = torch.stack((value, up), dim=-1).flatten(-2).contiguous()
    return out


# transformers' GptOssConfig defaults of the keys read here that a config.json may leave out
HF_DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 150000.0, "tie_word_embeddings": False, "head_dim": 64,
               "num_key_value_heads": 8, "sliding_window": 128, "num_local_experts": 128, "num_experts_per_tok": 4,
               "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True, "attention_dropout": 0.0,
               "hidden_act": "silu", "layer_types": None, "pad_token_id": None, "max_position_embeddings": 131072,
               "router_aux_loss_coef": 0.001, "output_router_logits": False,
               "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "truncate": False, "original_max_position_embeddings": 4096}}


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """raymesh ``model:`` fields from a GptOss ``config.json`` (its missing keys as ``GptOssConfig`` fills them);
    what this module does not compute as transformers does is refused naming the key. The training choices
    (``model.moe.aux_loss_weight``, ``balance_loss``) stay the job's, as for the other MoE families: transformers
    adds its pooled balance loss only under ``output_router_logits``, at ``router_aux_loss_coef``."""
    hf = {**HF_DEFAULTS, **hf}
    for key, needed in (("attention_bias", True), ("attention_dropout", 0.0), ("hidden_act", "silu")):
        if hf[key] != needed:
            raise ValueError(f"config.json {key} {hf[key]!r} is not supported for gpt_oss; it needs {needed!r}")
    types = hf["layer_types"] or [LAYER_TYPES[i % 2] for i in range(hf["num_hidden_layers"])]  # GptOssConfig's
    if len(types) != hf["num_hidden_layers"] or set(types) - set(LAYER_TYPES):
        raise ValueError(f"config.json layer_types {types} must give one of {list(LAYER_TYPES)} per layer "
                         f"({hf['num_hidden_layers']})")
    return {
        "arch": "gpt_oss", "vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"], "n_heads": hf["num_attention_heads"],
        "n_kv_heads": hf["num_key_value_heads"] or hf["num_attention_heads"], "head_dim": hf["head_dim"],
        "d_ff": hf["intermediate_size"], "norm_eps": hf["rms_norm_eps"], "tie_embeddings": hf["tie_word_embeddings"],
        "pad_token_id": hf["pad_token_id"], "sliding_window": hf["sliding_window"], "layer_types": types,
        "swiglu_alpha": hf["swiglu_alpha"], "swiglu_limit": hf["swiglu_limit"], **_rope_fields(hf),
        "moe": {"experts": hf["num_local_experts"], "top_k": hf["num_experts_per_tok"], "router": "topk",
                "d_expert": hf["intermediate_size"]},
    }


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta`` and ``rope_yarn`` from the config's rotary settings (v5 ``rope_parameters`` or v4
    ``rope_scaling``; a ``rope_theta`` missing there from the top level, else GptOssConfig's 150,000)."""
    rope = dict(hf.get("rope_scaling") or hf["rope_parameters"] or {"rope_type": "default"})
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", hf["rope_theta"])
    if kind == "default":
        return {"rope_theta": theta, "rope_yarn": None}
    if kind != "yarn":
        raise ValueError(f"config.json rope type {kind!r} is not supported for gpt_oss; it computes 'default' and "
                         "'yarn' rotary positions")
    unsupported = [k for k in ("attention_factor", "mscale", "mscale_all_dim", "partial_rotary_factor") if rope.get(k)]
    if unsupported:
        raise ValueError(f"config.json yarn setting {unsupported[0]} is not supported for gpt_oss; remove it")
    factor = rope.get("factor") or hf["max_position_embeddings"] / rope["original_max_position_embeddings"]
    yarn = {"factor": factor, "beta_fast": rope.get("beta_fast") or 32.0, "beta_slow": rope.get("beta_slow") or 1.0,
            "original_max_position_embeddings": rope["original_max_position_embeddings"],
            "truncate": rope.get("truncate", True)}
    return {"rope_theta": theta, "rope_yarn": yarn}


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` transformers builds ``cfg``'s ``GptOssForCausalLM`` from."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_yarn is not None:
        rope = {**rope, "rope_type": "yarn", **cfg.rope_yarn.model_dump()}
    moe = cfg.moe
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size,
        "intermediate_size": moe.d_expert or cfg.ffn_dim,
        "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.seq_len, "tie_word_embeddings": cfg.tie_embeddings,
        "pad_token_id": cfg.pad_token_id, "sliding_window": cfg.sliding_window, "layer_types": cfg.attention_types,
        "num_local_experts": moe.experts, "num_experts_per_tok": moe.k, "swiglu_alpha": cfg.swiglu_alpha,
        "swiglu_limit": cfg.swiglu_limit, "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu",
        "initializer_range": cfg.init_std, "torch_dtype": "float32",
    }


register(ModelFamily(
    arch="gpt_oss",
    config=ModelConfig,  # its fields are ModelConfig's (GPT_OSS_ONLY), so the job file's model: section holds them
    build=GptOss,
    lora_targets=("wq", "wk", "wv", "wo"),
    recompute_targets={"full": "", "selective": "attention.core"},
    hooks={
        "cut_stage": "workers.parallel.gpt_parallel:cut_stage",
        "tensor_parallel": "workers.parallel.gpt_oss_parallel:apply_tensor_parallel",
        "blocks": "workers.parallel.gpt_parallel:blocks",
        "init_parameter": "workers.model.gpt_oss:init_parameter",
    },
))
