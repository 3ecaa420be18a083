"""DeepSeek-V3 (``model.arch: deepseek_v3``): multi-head latent attention, the first ``dense_layers`` blocks dense
and the rest mixture-of-experts with sigmoid, group-limited routing (``model.moe.router: sigmoid``), the
aux-loss-free balancing bias (``bias_balancing``) and shared experts; Hugging Face ``DeepseekV3ForCausalLM``
weights in and out (``hf_state``, ``to_hf_state``, ``config_fields``, ``hf_config``).

Multi-head latent attention (MLA): the query through a low-rank ``wq_a`` (d -> q_lora_rank), an RMSNorm and
``wq_b`` (-> heads x (nope + rope)); keys and values from one compressed latent: ``wkv_a`` gives kv_lora_rank
channels (normed, then ``wkv_b`` -> heads x (nope + v)) and one rotary key of ``qk_rope_head_dim`` shared by all
heads (the "decoupled" rotary key). Training computes the expanded form (every head's keys and values). Decoding
(``workers.model.generation``) caches only the normed latent and the rotated key, kv_lora_rank + rope channels per
token and layer instead of heads x (nope + rope + v), and attends with ``wkv_b`` absorbed (``absorbed``). Rotary
pairs are interleaved (channels 2i, 2i+1), as DeepSeek's checkpoints lay them out.

Tensor parallelism splits MLA by heads (``workers.parallel.deepseek_parallel``: the down projections and latent
norms replicated, the up projections column-parallel, ``wo`` row-parallel).

Multi-token prediction (``model.mtp_layers``) is ``workers.model.mtp``; its checkpoint layers (from index
``num_hidden_layers`` on, which ``transformers`` drops) are named here (``_MTP``, ``hf_name``, ``mtp_copies``).

Not built: yarn rotary scaling.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.model import mtp
from workers.model.config import ModelConfig
from workers.model.generation import prefix_mask
from workers.model.gpt import GPT, RMSNorm, chunked_lm_loss, lm_loss, token_positions
from workers.model.llama import SwiGLU
from workers.model.moe import MoELayer, share_balance_pool
from workers.model.names import mapped_name
from workers.model.registry import ModelFamily, register

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which the q and kv latent norms keep


def rotary_interleaved(x: torch.Tensor, theta: float, positions: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of ``x`` [batch, heads, seq, r] by frequency i; the result lists the pairs'
    first halves then their second halves (transformers' ``apply_rotary_pos_emb_interleave``: the same permutation
    on queries and keys, so their products are the interleaved rotation's)."""
    r = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, device=x.device, dtype=torch.float32) / r))
    angles = torch.outer(positions.to(torch.float32), inv_freq)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class LatentAttention(nn.Module):
    """Multi-head latent attention (see the module docstring); causal, scaled by 1/sqrt(nope + rope)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg, heads = cfg, cfg.n_heads
        self.qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            self.wq = nn.Linear(cfg.d_model, heads * self.qk_dim, bias=False)
        else:
            self.wq_a = nn.Linear(cfg.d_model, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, heads * self.qk_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.d_model, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(heads * cfg.v_head_dim, cfg.d_model, bias=False)
        # cp is refused for this family: set only while decoding (workers.model.generation's layer cache)
        self.context_shard = None

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, d] -> [b, s, heads x (nope + rope)], through the low-rank path when there is one."""
        if self.cfg.q_lora_rank is None:
            return self.wq(x)
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        cfg = self.cfg
        nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q = self.query(x).view(b, s, -1, self.qk_dim).transpose(1, 2)
        latent, k_rot = self.wkv_a(x).split([cfg.kv_lora_rank, rope], dim=-1)
        positions = token_positions(self.context_shard, s, x.device)
        q_nope, q_rot = q.split([nope, rope], dim=-1)
        q_rot = rotary_interleaved(q_rot, cfg.rope_theta, positions)
        k_rot = rotary_interleaved(k_rot.view(b, 1, s, rope), cfg.rope_theta, positions)
        latent = self.kv_norm(latent)
        if self.context_shard is None:
            out = self.expanded(q_nope, q_rot, latent, k_rot)
        else:  # decoding (workers.model.generation): only the latent and the rotary key are cached
            latent, k_rot = self.context_shard.extend(latent, k_rot[:, 0])
            mask = prefix_mask(s, latent.shape[1], x.device)
            if isinstance(self.wkv_b, nn.Linear):
                out = self.absorbed(q_nope, q_rot, latent, k_rot, mask)
            else:  # a wrapped up projection (LoRA): expand the cached latent through it
                out = self.expanded(q_nope, q_rot, latent, k_rot.unsqueeze(1), mask, causal=False)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def expanded(self, q_nope: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor,
                 mask: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
        """Attention with every head's keys and values made from the normed ``latent`` [b, t, r] by ``wkv_b``
        (what training computes): queries [b, h, s, ·], the rotated shared key [b, 1, t, rope]; -> [b, h, s, v]."""
        cfg = self.cfg
        b, t, _ = latent.shape
        kv = self.wkv_b(latent).view(b, t, -1, cfg.qk_nope_head_dim + cfg.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, q.shape[1], -1, -1)), dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=1.0 / math.sqrt(self.qk_dim))

    def absorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """The same attention over the cached ``latent`` [b, t, r] and rotary key [b, t, rope] without expanding
        them (DeepSeek's inference): ``wkv_b``'s key half folded into the queries (q_nope W_uk: a query in latent
        space, scored against the latent itself), its value half applied to the latent-space output, so a step
        costs O(t x (r + rope)) per head instead of building t keys and values per head."""
        cfg = self.cfg
        heads = q_nope.shape[1]
        w = self.wkv_b.weight.view(heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        w_k, w_v = w.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
        q = torch.cat((torch.einsum("bhsn,hnr->bhsr", q_nope, w_k), q_rot), dim=-1)
        k = torch.cat((latent, k_rot), dim=-1).unsqueeze(1).expand(-1, heads, -1, -1)
        out = F.scaled_dot_product_attention(q, k, latent.unsqueeze(1).expand(-1, heads, -1, -1), attn_mask=mask,
                                             scale=1.0 / math.sqrt(self.qk_dim))
        return torch.einsum("bhsr,hvr->bhsv", out, w_v)


class DeepseekBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = LatentAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = MoELayer(cfg, layer, swiglu=True) if cfg.is_moe_layer(layer) else SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class DeepseekMTP(mtp.MTPLayer, DeepseekBlock):
    """A multi-token prediction depth: a ``DeepseekBlock`` with its input projection and norms."""


class DeepseekV3(GPT):
    """The DeepSeek-V3 decoder: GPT's forward (embed, blocks, norm, head) over ``DeepseekBlock``s."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embeddings = None
        self.context_shard, self.documents = None, None
        self.layers = nn.ModuleDict({str(i): DeepseekBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.mtp = mtp.MultiTokenPrediction(cfg, DeepseekMTP, RMSNorm) if cfg.mtp_layers else None
        share_balance_pool(self)
        if not self.layers["0"].attention.wkv_a.weight.is_meta:
            self.init_weights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.mtp is None else mtp.forward_keeping(self, x)

    def mtp_loss(self, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """L_MTP of the last training forward (``workers.model.mtp``), through this model's head and loss."""
        return self.mtp.loss(self._head_loss, targets, reduction)

    def _head_loss(self, hidden: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        if self.loss_chunks > 1:
            return chunked_lm_loss(hidden, targets, self.output, self.loss_chunks, reduction)
        return lm_loss(self.output(hidden), targets, reduction)


# -- Hugging Face DeepseekV3ForCausalLM ----------------------------------------------------------------------------

_ENDS = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
         "output.weight": "lm_head.weight"}
_LAYER = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wq_a.weight": "self_attn.q_a_proj.weight",
          "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
          "attention.wq_b.weight": "self_attn.q_b_proj.weight",
          "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
          "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
          "attention.wkv_b.weight": "self_attn.kv_b_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
          "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
          "feed_forward.w2.weight": "mlp.down_proj.weight", "feed_forward.router.weight": "mlp.gate.weight",
          "feed_forward.router.bias": "mlp.gate.e_score_correction_bias"}
_MATRIX = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACK = re.compile(r"(?:layers|mtp)\.(\d+)\.feed_forward\.(experts|shared)\.(w[123])")


def shared_key(name: str) -> str:
    """The Hugging Face name of a shared-experts stack ``layers.{i}.feed_forward.shared.w1`` (one Linear on disk)."""
    layer, _, matrix = _STACK.fullmatch(name).groups()
    return f"model.layers.{layer}.mlp.shared_experts.{_MATRIX[matrix]}.weight"


def shared_shape(stack: tuple[int, ...], name: str) -> tuple[int, int]:
    """The on-disk shape of shared-experts stack ``name`` of shape [n, a, b]: gate/up [n*h, d], down [d, n*h]."""
    count, a, b = stack
    return (b, count * a) if name.endswith("w2") else (count * b, a)


def shared_stack(tensor: torch.Tensor, name: str, count: int) -> torch.Tensor:
    """The [n, a, b] stack of shared experts held on disk as one Linear weight ``tensor`` (their hidden units side
    by side): gate/up [n*h, d] -> [n, d, h]; down [d, n*h] -> [n, h, d]."""
    if name.endswith("w2"):
        return tensor.t().reshape(count, -1, tensor.shape[0])
    return tensor.reshape(count, -1, tensor.shape[1]).transpose(1, 2)


def shared_tensor(stack: torch.Tensor, name: str) -> torch.Tensor:
    """``shared_stack``'s inverse: the one Linear weight of a [n, a, b] shared-experts stack."""
    if name.endswith("w2"):
        return torch.cat(list(stack), dim=0).t().contiguous()
    return torch.cat(list(stack), dim=1).t().contiguous()


def to_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full raymesh DeepSeek-V3 state dict (the router's balancing bias included) as the tensors
    ``DeepseekV3ForCausalLM.save_pretrained`` writes: each routed expert its own three matrices, the shared experts
    one MLP (``shared_tensor``)."""
    depths = sorted(int(m.group(1)) for m in map(_MTP_NAME.fullmatch, state) if m and m.group(2) == "enorm.weight")
    out = mtp_copies(state, depths[0], len(depths)) if depths else {}
    for name, value in state.items():
        m = _STACK.fullmatch(name)
        if m is None:
            out[hf_name(name)] = value.contiguous()
        elif m.group(2) == "shared":
            out[shared_key(name)] = shared_tensor(value, name)
        else:  # [E, a, b] -> E Linear weights [b, a]
            out.update({expert_key(name, e): value[e].t().contiguous() for e in range(value.shape[0])})
    return out


def expert_key(name: str, expert: int) -> str:
    """The Hugging Face name of routed expert ``expert``'s matrix in stack ``layers.{i}.feed_forward.experts.w1``."""
    layer, _, matrix = _STACK.fullmatch(name).groups()
    return f"model.layers.{layer}.mlp.experts.{expert}.{_MATRIX[matrix]}.weight"


def hf_state(tensors: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s full state dict (parameters and the routers' bias buffers) read from a DeepseekV3 checkpoint's
    ``tensors``; a tensor missing or of another shape is an error naming it."""
    state = {}
    for name, target in model.state_dict().items():
        m = _STACK.fullmatch(name)
        if m is None:
            state[name] = _take(tensors, hf_name(name), target.shape)
        elif m.group(2) == "shared":
            state[name] = shared_stack(_take(tensors, shared_key(name), shared_shape(target.shape, name)), name,
                                       target.shape[0])
        else:
            count, a, b = target.shape
            state[name] = torch.stack([_take(tensors, expert_key(name, e), (b, a)).t() for e in range(count)])
    return state


def _take(tensors: dict[str, torch.Tensor], key: str, shape) -> torch.Tensor:
    if key not in tensors:
        raise ValueError(f"the DeepseekV3 checkpoint has no tensor {key!r}")
    if tuple(tensors[key].shape) != tuple(shape):
        raise ValueError(f"DeepseekV3 tensor {key} has shape {list(tensors[key].shape)}, the model needs "
                         f"{list(shape)}: config.json and the weights disagree")
    return tensors[key]


# an MTP depth's own tensors, under its checkpoint layer model.layers.{num_hidden_layers + k - 1}
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "norm.weight": "shared_head.norm.weight"}
_MTP_NAME = re.compile(r"mtp\.(\d+)\.(.+)")
# the checkpoint's copies of the shared embedding and head in each MTP layer (one parameter each here)
_MTP_COPIES = {"tok_embeddings.weight": "embed_tokens.weight", "output.weight": "shared_head.head.weight"}


def hf_name(name: str) -> str:
    """The checkpoint name of raymesh tensor ``name``; an MTP depth's (``mtp.{i}.*``) are layer ``i``'s, its block
    named as a main block's."""
    m = _MTP_NAME.fullmatch(name)
    if m is not None and m.group(2) in _MTP:
        return f"model.layers.{m.group(1)}.{_MTP[m.group(2)]}"
    if m is not None:
        name = f"layers.{m.group(1)}.{m.group(2)}"
    return mapped_name(name, _ENDS, _LAYER, "DeepseekV3")


def held_mtp_layers(hf: dict[str, Any], names) -> int:
    """How many of config.json's ``num_nextn_predict_layers`` MTP layers the checkpoint's tensor ``names`` hold:
    ``transformers`` writes the key (its default 1) but builds and saves no MTP layer."""
    first = hf["num_hidden_layers"]
    depths = range(first, first + (hf.get("num_nextn_predict_layers") or 0))
    return sum(1 for _ in itertools.takewhile(lambda i: f"model.layers.{i}.eh_proj.weight" in names, depths))


def mtp_copies(state: dict[str, torch.Tensor], n_layers: int, depths: int) -> dict[str, torch.Tensor]:
    """The shared embedding and head written again under each MTP layer, as DeepSeek's checkpoints hold them."""
    return {f"model.layers.{layer}.{key}": state[name].clone() for layer in range(n_layers, n_layers + depths)
            for name, key in _MTP_COPIES.items() if name in state}


# transformers' DeepseekV3Config defaults of the keys read here that a config.json may leave out
HF_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "q_lora_rank": 1536,
               "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
               "first_k_dense_replace": 3, "n_shared_experts": 1, "rope_interleave": True, "hidden_act": "silu",
               "attention_bias": False, "attention_dropout": 0.0}


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """raymesh ``model:`` fields (a ``ModelConfig``) from a DeepseekV3 ``config.json``; what this module does not
    compute as transformers does is refused naming the key. The training choices (``bias_balancing``, the
    balance loss's weight) stay the job's: the checkpoint's bias is read either way and steers the choice."""
    hf = {**HF_DEFAULTS, **hf}
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"config.json rope type {rope.get('rope_type')!r} is not supported for deepseek_v3 (yarn "
                         "scaling is not implemented); use a checkpoint with default rotary positions")
    for key in ("attention_bias", "attention_dropout"):
        if hf[key]:
            raise ValueError(f"config.json {key} {hf[key]} is not supported for deepseek_v3; set it to 0/false")
    if not hf["rope_interleave"]:
        raise ValueError("config.json rope_interleave false is not supported; raymesh's MLA rotates interleaved pairs")
    return {
        "arch": "deepseek_v3", "vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"], "n_heads": hf["num_attention_heads"], "d_ff": hf["intermediate_size"],
        "norm_eps": hf["rms_norm_eps"], "rope_theta": rope.get("rope_theta", hf["rope_theta"]),
        "tie_embeddings": bool(hf["tie_word_embeddings"]), "q_lora_rank": hf["q_lora_rank"],
        "kv_lora_rank": hf["kv_lora_rank"], "qk_nope_head_dim": hf["qk_nope_head_dim"],
        "qk_rope_head_dim": hf["qk_rope_head_dim"], "v_head_dim": hf["v_head_dim"],
        "dense_layers": hf["first_k_dense_replace"],
        "moe": {"experts": hf["n_routed_experts"], "top_k": hf["num_experts_per_tok"], "router": "sigmoid",
                "d_expert": hf["moe_intermediate_size"], "shared_experts": hf["n_shared_experts"],
                "groups": hf["n_group"], "top_groups": hf["topk_group"], "gate_scale": hf["routed_scaling_factor"],
                "norm_topk": bool(hf["norm_topk_prob"])},
    }


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` transformers builds ``cfg``'s ``DeepseekV3ForCausalLM`` from."""
    moe = cfg.moe
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads, "intermediate_size": cfg.ffn_dim, "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}, "rope_interleave": True,
        "tie_word_embeddings": cfg.tie_embeddings, "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "first_k_dense_replace": cfg.dense_layers,
        "max_position_embeddings": cfg.seq_len, "n_routed_experts": moe.experts, "num_experts_per_tok": moe.k,
        "moe_intermediate_size": moe.d_expert or cfg.ffn_dim, "n_shared_experts": moe.shared_experts,
        "n_group": moe.groups, "topk_group": moe.top_groups or moe.groups, "routed_scaling_factor": moe.gate_scale,
        "norm_topk_prob": moe.norm_topk, "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
        "num_nextn_predict_layers": cfg.mtp_layers,
    }


register(ModelFamily(
    arch="deepseek_v3",
    config=ModelConfig,  # its fields are ModelConfig's (DEEPSEEK_ONLY), so the job file's model: section holds them
    build=DeepseekV3,
    lora_targets=("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "w1", "w2", "w3"),
    recompute_targets={"full": ""},
    hooks={
        "cut_stage": "workers.parallel.gpt_parallel:cut_stage",
        "blocks": "workers.parallel.gpt_parallel:blocks",
        "init_parameter": "workers.model.gpt:init_parameter",
        "tensor_parallel": "workers.parallel.deepseek_parallel:apply_tensor_parallel",
    },
))
