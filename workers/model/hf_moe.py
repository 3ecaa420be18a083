"""Hugging Face mixture-of-experts checkpoints (Qwen3-MoE, Mixtral) as raymesh's Llama with ``model.moe``: the
``config.json`` keys <-> ``MoEConfig`` fields, and each expert's tensors on disk <-> raymesh's expert stacks.

Both families are a Llama whose feed-forward is, in every MoE layer, a linear ``gate`` (d_model -> E logits),
softmax over all experts, top-k, the k probabilities renormalised (Mixtral always, Qwen3-MoE under
``norm_topk_prob``), and no token dropped: raymesh's ``router: topk`` (``norm_topk``), which has no capacity.
Which layers: Qwen3-MoE's layer i when (i + 1) % ``decoder_sparse_step`` == 0, as raymesh's ``model.moe.every``
places them; ``mlp_only_layers`` that turn one of those dense are refused (raymesh cannot place them).

On disk (``save_pretrained`` of transformers 5, and the published checkpoints) each expert is three ``nn.Linear``
weights, ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`` (Mixtral:
``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``); transformers fuses them in memory when it loads. raymesh
stacks them: ``w1``/``w3`` [E, d, h] hold expert e's gate/up weights transposed, ``w2`` [E, h, d] its down one.

Not mapped: ``router_aux_loss_coef``. transformers' balance loss (only with ``output_router_logits``) is one
E * sum_e f_e * P_e over the tokens of all layers pooled; raymesh's default topk loss is that product per layer
and per routing group, summed over layers, so the same weight would not weigh the same loss. The job's
``model.moe.aux_loss_weight`` applies; with ``model.moe.balance_loss: pooled`` (``moe.BalancePool``) the loss is
transformers' and the checkpoint's coefficient can be given as that weight (the export carries the source's key
along, ``hf_io.AUX_LOSS_KEYS``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from workers.model.config import ModelConfig


@dataclass(frozen=True)
class HfExperts:
    """Where a family's MoE block keeps its router and experts on disk: the block's name under the layer and
    each expert's weight per raymesh stack (``w1``: gate, ``w3``: up, ``w2``: down)."""

    block: str
    matrices: dict[str, str]

    def router(self, layer: str) -> str:
        return f"model.layers.{layer}.{self.block}.gate.weight"

    def expert(self, layer: str, stack: str, expert: int) -> str:
        return f"model.layers.{layer}.{self.block}.experts.{expert}.{self.matrices[stack]}.weight"


EXPERT_NAMES = {
    "qwen3_moe": HfExperts("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
    "mixtral": HfExperts("block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"}),
    "deepseek_v3": HfExperts("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
}

ROUTER = re.compile(r"(?:layers|mtp)\.(\d+)\.feed_forward\.router\.weight")
STACK = re.compile(r"(?:layers|mtp)\.(\d+)\.feed_forward\.experts\.(w[123])")
ROUTER_BIAS = re.compile(r"(?:layers|mtp)\.\d+\.feed_forward\.router\.bias")


def router_name(name: str, kind: str) -> str | None:
    """The Hugging Face name of a raymesh router weight (``layers.3.feed_forward.router.weight``), else None."""
    m = ROUTER.fullmatch(name)
    return EXPERT_NAMES[kind].router(m.group(1)) if m and kind in EXPERT_NAMES else None


def expert_name(name: str, kind: str, expert: int) -> str:
    """The Hugging Face name of global expert ``expert``'s matrix in the raymesh stack ``name``
    (``layers.3.feed_forward.experts.w1`` -> ``model.layers.3.mlp.experts.{expert}.gate_proj.weight``)."""
    m = STACK.fullmatch(name)
    if m is None or kind not in EXPERT_NAMES:
        raise KeyError(f"{name!r} has no Hugging Face {kind} counterpart; model.hf_model_type must be one of "
                       f"{sorted(EXPERT_NAMES)} to export experts")
    return EXPERT_NAMES[kind].expert(m.group(1), m.group(2), expert)


# -- config.json --------------------------------------------------------------------------------------------------

# config.json keys of MoE families raymesh's MoE layer has nothing for (Qwen2-MoE's, DeepSeek's shared experts)
SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")


def moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """``d_ff`` and ``model.moe`` from a Qwen3-MoE or Mixtral ``config.json``; ``ValueError`` naming the key for
    what raymesh's MoE cannot compute as transformers does."""
    _check_moe_keys(hf)
    if hf["model_type"] == "mixtral":  # every layer an MoE one, renormalised, intermediate_size per expert
        return {"d_ff": hf["intermediate_size"],
                "moe": _moe(hf["num_local_experts"], hf, hf["intermediate_size"], every=1, norm=True)}
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    every = hf.get("decoder_sparse_step", 1)
    _check_moe_layers(hf, experts, every)
    return {"d_ff": hf["intermediate_size"],
            "moe": _moe(experts, hf, hf["moe_intermediate_size"], every, bool(hf.get("norm_topk_prob", False)))}


def _moe(experts: int, hf: dict[str, Any], width: int, every: int, norm: bool) -> dict[str, Any]:
    return {"experts": experts, "top_k": hf["num_experts_per_tok"], "d_expert": width, "every": every,
            "norm_topk": norm, "router": "topk"}


def _check_moe_keys(hf: dict[str, Any]) -> None:
    """Refuse shared experts and Mixtral's router jitter (transformers scales inputs by noise in training)."""
    for key in SHARED_EXPERT_KEYS:
        if hf.get(key):
            raise ValueError(f"config.json {key} {hf[key]} adds shared experts, which raymesh's "
                             f"{hf['model_type']} does not read; use a checkpoint without them")
    if hf.get("router_jitter_noise"):
        raise ValueError(f"config.json router_jitter_noise {hf['router_jitter_noise']} is not supported (raymesh's "
                         "router has no input jitter; transformers applies it in training); set "
                         "router_jitter_noise: 0.0 in config.json to fine-tune without it")


def _check_moe_layers(hf: dict[str, Any], experts: int | None, every: int) -> None:
    """Qwen3-MoE's MoE layers must be model.moe.every's: some, and no ``mlp_only_layers`` among them."""
    layers = hf["num_hidden_layers"]
    if not experts or every > layers:
        key, value = ("num_experts", experts) if not experts else ("decoder_sparse_step", every)
        raise ValueError(f"config.json {key} {value} leaves no MoE layer in {layers} layers; use a qwen3 "
                         "(dense) checkpoint, or fix config.json")
    dense = sorted(i for i in hf.get("mlp_only_layers") or [] if (i + 1) % every == 0 and i < layers)
    if dense:
        raise ValueError(f"config.json mlp_only_layers makes layers {dense} dense, which raymesh's model.moe.every "
                         f"{every} (every {every}-th layer) cannot place; use a checkpoint with mlp_only_layers: []")


def moe_config(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` keys ``transformers`` builds ``cfg``'s MoE layers from (its ``hf_model_type``)."""
    moe = cfg.moe
    width = moe.d_expert or cfg.ffn_dim
    if cfg.hf_model_type == "mixtral":
        return {"num_local_experts": moe.experts, "num_experts_per_tok": moe.k, "intermediate_size": width,
                "router_jitter_noise": 0.0, "output_router_logits": False}
    return {"num_experts": moe.experts, "num_experts_per_tok": moe.k, "moe_intermediate_size": width,
            "decoder_sparse_step": moe.every, "mlp_only_layers": [], "norm_topk_prob": moe.norm_topk,
            "output_router_logits": False}
