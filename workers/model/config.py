"""``ModelConfig``: a transformer's shape, declared once.

The orchestrator's ``model:`` section (``ModelSpec``) subclasses it to add
fine-tuning (``lora``) and the checks that name a field and its fix; the
workers build the model from it. ``arch`` picks the family in the model
registry (``workers.model.registry``).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from workers.contract.fields import STRICT

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class RopeScaling(BaseModel):
    """Llama-3's rotary frequency scaling: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp
    between (the wavelength bounds are ``original_max_position_embeddings`` over the two frequency factors)."""

    model_config = STRICT  # a nested section: as strict as the spec's own (no inf, no quoted numbers)

    factor: PositiveFloat = 8.0
    low_freq_factor: PositiveFloat = 1.0
    high_freq_factor: PositiveFloat = 4.0
    original_max_position_embeddings: PositiveInt = 8192


# fields only the Llama family reads; a GPT job setting one is refused rather than silently ignoring it
LLAMA_ONLY = ("n_kv_heads", "rope_theta", "rope_scaling", "multiple_of", "ffn_dim_multiplier", "tie_embeddings",
              "pad_token_id", "head_dim", "qkv_bias", "qk_norm", "hf_model_type", "sliding_window")
# fields only the DeepSeek-V3 family reads (and the Llama ones it does not: it has no grouped K/V heads, no head_dim)
DEEPSEEK_ONLY = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "dense_layers",
                 "mtp_layers", "mtp_loss_weight")
# fields only gpt-oss reads (workers.model.gpt_oss); another arch refuses them, and gpt-oss the Llama ones it does not
GPT_OSS_ONLY = ("layer_types", "swiglu_alpha", "swiglu_limit", "rope_yarn")
GPT_OSS_UNREAD = ("rope_scaling", "multiple_of", "ffn_dim_multiplier", "qkv_bias", "qk_norm", "hf_model_type")
DEEPSEEK_UNREAD = ("n_kv_heads", "rope_scaling", "head_dim", "qkv_bias", "qk_norm", "hf_model_type", "multiple_of",
                   "ffn_dim_multiplier", "pad_token_id", "sliding_window")
# the Hugging Face families raymesh's one Llama implementation reads and writes (workers.model.hf_io.FAMILIES)
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
# the mixture-of-experts ones among them: their checkpoints need ``model.moe`` (router topk, no shared experts)
HF_MOE_TYPES = ("qwen3_moe", "mixtral")
# the model fields a family's weights always have (the rest off): Qwen2's q/k/v biases, Qwen3's (and Qwen3-MoE's)
# q/k norms; here, torch-free, so the job-file checks read it without importing hf_io
HF_FAMILY_FIELDS = {kind: {"qkv_bias": kind == "qwen2", "qk_norm": kind in ("qwen3", "qwen3_moe")}
                    for kind in HF_MODEL_TYPES}


def swiglu_hidden(d_model: int, multiple_of: int, multiplier: float | None) -> int:
    """Llama's SwiGLU width: 2/3 of 4*d_model (three matrices cost what GPT's two do), times ``multiplier``,
    rounded up to ``multiple_of``."""
    hidden = int(2 * 4 * d_model / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class YarnScaling(BaseModel):
    """YaRN rotary scaling (Peng et al. 2023, transformers' ``rope_type: yarn``), as gpt-oss uses it: each channel
    pair's frequency blended between interpolated (divided by ``factor``) and kept by a linear ramp over the pairs
    whose wavelength fits between ``beta_fast`` and ``beta_slow`` turns within ``original_max_position_embeddings``;
    rotated queries and keys scaled by 0.1 ln(factor) + 1."""

    model_config = STRICT  # a nested section: as strict as the spec's own (no inf, no quoted numbers)

    factor: float = Field(32.0, ge=1, description="context extension: the interpolated frequencies are divided by "
                          "it, and q/k scaled by 0.1 ln(factor) + 1 (gpt-oss: 32)")
    beta_fast: PositiveFloat = Field(32.0, description="the ramp's fast end: pairs turning more than this many times "
                                     "over the original context keep their frequency")
    beta_slow: PositiveFloat = Field(1.0, description="the ramp's slow end: pairs turning fewer times than this are "
                                     "fully interpolated")
    original_max_position_embeddings: PositiveInt = Field(4096, description="the context the model was pretrained "
                                                          "at, which the turns are counted over")
    truncate: bool = Field(False, description="round the ramp's ends outward to whole pairs (transformers' default "
                           "true; gpt-oss's config false)")


LAYER_TYPES = ("sliding_attention", "full_attention")
ROUTERS = ("topk", "noisy_topk", "gshard", "switch", "expert_choice", "hierarchical", "sigmoid")
# routers whose paper fixes k: GShard routes to two experts, Switch to one (model.moe.top_k must agree)
ROUTER_TOP_K = {"gshard": 2, "switch": 1}


class MoEConfig(BaseModel):
    """``model.moe``: a mixture-of-experts feed-forward in every ``every``-th block (``workers.model.moe``).

    Bounds the spec reports by field (``orchestrator.spec.moe``) are declared here so a worker sees the same.
    """

    model_config = ConfigDict(extra="forbid")

    experts: Annotated[int, Field(ge=2)] = 8  # routed experts per MoE layer
    every: Annotated[int, Field(ge=1)] = 1  # blocks every-1, 2*every-1, ... get the MoE feed-forward (2: GShard)
    router: Literal[ROUTERS] = "topk"  # type: ignore[valid-type]
    top_k: PositiveInt | None = None  # experts per token (null: 2, or the router's own: gshard 2, switch 1)
    # bounded: past the expert count nothing can be dropped, and a huge factor overflows the integer capacity
    # capacity = ceil(factor * tokens * k / experts) per routing group
    capacity_factor: Annotated[float, Field(gt=0, le=1024)] = 1.25
    group: Literal["sequence", "microbatch"] = "sequence"  # the routing group capacity and aux losses are per
    shared_experts: Annotated[int, Field(ge=0)] = 0  # always-on experts every token passes (DeepSeek)
    d_expert: PositiveInt | None = None  # each expert's hidden width (null: the dense feed-forward's)
    aux_loss_weight: Annotated[float, Field(ge=0, le=100)] = 0.01  # the router's balancing loss weight
    # router z-loss weight (ST-MoE): mean logsumexp(logits)^2
    z_loss_weight: Annotated[float, Field(ge=0, le=100)] = 0.0
    expert_dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0  # dropout inside the experts only (Switch)
    bias_balancing: bool = False  # DeepSeek-V3's aux-loss-free balancing (router topk only)
    bias_update_rate: Annotated[float, Field(ge=0, le=1)] = 0.001  # its per-step bias change, by the sign of load error
    # router topk: the k chosen probabilities renormalised to sum to one (Mixtral; Qwen3-MoE's norm_topk_prob); false
    # keeps them as the softmax over all experts gave them
    norm_topk: bool = True
    expert_groups: PositiveInt | None = Field(
        default=None, description="router hierarchical (Shazeer et al. 2017's two-level MoE): the experts split into "
        "this many equal groups; a group gate picks group_top_k groups per token, then each chosen group's gate "
        "its top_k experts. At least 2, dividing experts; required by (and only read by) router hierarchical")
    group_top_k: PositiveInt = Field(default=1, description="router hierarchical: groups each token is sent to "
                                     "(at most expert_groups)")
    max_experts_per_token: PositiveInt | None = Field(
        default=None, description="router expert_choice: at most this many experts per token (the capped form, "
        "solved by Dykstra's algorithm: workers/model/ec_dykstra.py); at least capacity_factor and below experts. "
        "Unset: uncapped expert choice")
    ec_entropy: Annotated[float, Field(gt=0, le=10, description="the capped expert choice's entropy weight λ on "
                                       "softmax scores in [0, 1]: smaller is closer to the unregularised choice, "
                                       "needs more iterations")] = 0.05
    ec_iterations: Annotated[int, Field(ge=1, le=10000, description="the capped expert choice's Dykstra cycles "
                                        "per routing group and forward (200 at λ 0.05 settle the picks of "
                                        "groups of 32-128 tokens over 4-8 experts)")] = 200
    groups: PositiveInt = Field(1, description="router sigmoid (DeepSeek-V3's n_group): the experts in this many "
                                "equal groups; a token picks its experts from its top_groups best groups only "
                                "(a group scores the sum of its two best biased scores). Must divide experts.")
    top_groups: PositiveInt | None = Field(None, description="router sigmoid (DeepSeek-V3's topk_group): how many "
                                           "groups a token's experts come from; null: all groups.")
    gate_scale: PositiveFloat = Field(1.0, description="router sigmoid (DeepSeek-V3's routed_scaling_factor): the "
                                      "chosen experts' gates, after norm_topk, times this.")
    balance_loss: Literal["per_layer", "pooled"] = Field(
        "per_layer", description="How router topk's balance loss (weight aux_loss_weight) is formed. per_layer: "
        "E * sum_i f_i * P_i for each MoE layer, summed over layers (raymesh's). pooled: f and P averaged over all "
        "MoE layers first, then one product (transformers' load_balancing_loss_func, Mixtral and Qwen3-MoE, so a "
        "checkpoint's router_aux_loss_coef weighs the loss it was chosen for; needs parallel.pp 1). Read by "
        "workers.model.moe.BalancePool.")

    @property
    def k(self) -> int:
        """Experts each token asks for (token-choice routers)."""
        return self.top_k if self.top_k is not None else ROUTER_TOP_K.get(self.router, 2)

    def capacity(self, tokens: int, k: int) -> int:
        """Expert capacity of one routing group of ``tokens`` asking ``k`` experts each:
        ceil(capacity_factor * tokens * k / experts). Here, not in ``workers.model.moe``, so the planner sizes
        it without importing torch."""
        return math.ceil(self.capacity_factor * tokens * k / self.experts)


class ModelConfig(BaseModel):
    """Transformer shape; unknown keys are errors (a misspelt field never silently takes its default)."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: PositiveInt = 256
    d_model: PositiveInt = 64
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 4
    d_ff: PositiveInt | None = None
    seq_len: PositiveInt = 64
    positions: Literal["rotary", "learned"] = "rotary"
    # document: each token attends only to earlier tokens of its own document (workers.model.documents)
    attention_mask: Literal["causal", "document"] = "causal"
    norm_eps: PositiveFloat = 1e-5
    init_std: PositiveFloat = 0.02
    # the model family (see workers.model.registry); "hf" is any other Hugging Face causal LM, which only
    # model.init_from sets (workers.model.hf_any)
    arch: Literal["gpt", "llama", "deepseek_v3", "gpt_oss", "hf"] = "gpt"
    # Llama-family fields (``LLAMA_ONLY``: a gpt refuses them, see orchestrator.spec.model)
    n_kv_heads: PositiveInt | None = None  # grouped-query attention: K/V heads (null: n_heads, plain multi-head)
    rope_theta: PositiveFloat = 10000.0  # rotary base
    rope_scaling: RopeScaling | None = None  # Llama-3 long-context frequency scaling; null: none
    multiple_of: PositiveInt = 256  # SwiGLU hidden size rounded up to a multiple of this (when d_ff is null)
    ffn_dim_multiplier: PositiveFloat | None = None  # SwiGLU hidden size scaled by this before rounding
    tie_embeddings: bool = False  # output head shares the token embedding's weight
    # the token whose embedding row gets no gradient from the lookup (transformers' padding_idx); null: none
    pad_token_id: Annotated[int, Field(ge=0)] | None = None
    # each attention head's width; null: d_model / n_heads. Qwen3 (and some Mistral/Llama) checkpoints give
    # another, and q/k/v/o are then n_heads * head_dim wide
    head_dim: PositiveInt | None = None
    qkv_bias: bool = False  # biases on the q, k and v projections (not o): Qwen2/2.5
    qk_norm: bool = False  # RMSNorm over head_dim on each query and key head before rotary: Qwen3
    sliding_window: PositiveInt | None = Field(None, description=(
        "Sliding-window attention: a token attends to itself and the sliding_window - 1 tokens before it "
        "(transformers' Mistral window), in every layer; null: the whole causal prefix. Any positive length, "
        "shorter than seq_len or not; init_from sets it from a Mistral/Mixtral config.json, or a Qwen one whose "
        "every layer is windowed. Read by the attention cores (workers.model.gpt.CausalCore): no [S, S] mask is "
        "built, and tiles out of the window are skipped (workers.parallel.context_parallel)."))
    # the Hugging Face family an export writes (config.json model_type); init_from sets it from its config.json
    hf_model_type: Literal[HF_MODEL_TYPES] = "llama"  # type: ignore[valid-type]
    moe: MoEConfig | None = None  # mixture-of-experts feed-forwards; null: dense model
    hf_config: dict[str, Any] | None = Field(
        default=None, description="model.arch hf only: the config.json of model.init_from, which transformers "
        "builds the model from (workers.model.hf_any); filled in by model.init_from, not written by hand")
    # DeepSeek-V3's fields (``DEEPSEEK_ONLY``: another arch refuses them; workers.model.deepseek reads them)
    q_lora_rank: PositiveInt | None = Field(None, description="deepseek_v3 MLA: the query's low-rank width (null: "
                                            "one full d_model -> heads x (nope + rope) projection)")
    kv_lora_rank: PositiveInt = Field(32, description="deepseek_v3 MLA: the compressed key/value latent's width")
    qk_nope_head_dim: PositiveInt = Field(16, description="deepseek_v3 MLA: per-head query/key channels without "
                                          "rotary")
    qk_rope_head_dim: PositiveInt = Field(8, description="deepseek_v3 MLA: per-head query channels with rotary, and "
                                          "the width of the one rotary key every head shares (even)")
    v_head_dim: PositiveInt = Field(16, description="deepseek_v3 MLA: per-head value channels")
    dense_layers: int = Field(1, ge=0, description="deepseek_v3: the first blocks keep a dense SwiGLU feed-forward "
                              "(d_ff wide), the rest are MoE (transformers' first_k_dense_replace)")
    mtp_layers: int = Field(0, ge=0, le=8, description="deepseek_v3: multi-token prediction depths D (DeepSeek-V3 "
                            "trains 1; config.json num_nextn_predict_layers): module k predicts the token k+1 after "
                            "the next one and adds its loss (workers.model.mtp); 0: none")
    mtp_loss_weight: float = Field(0.3, ge=0.0, le=10.0, description="deepseek_v3 with model.mtp_layers > 0: lambda "
                                   "in L_MTP = lambda / D * sum of the D depths' cross entropies, added to the "
                                   "next-token loss (DeepSeek-V3: 0.3, then 0.1)")

    # gpt-oss's fields (``GPT_OSS_ONLY``: another arch refuses them; workers.model.gpt_oss reads them)
    layer_types: list[Literal[LAYER_TYPES]] | None = Field(  # type: ignore[valid-type]
        None, description="gpt_oss: each layer's attention, sliding_attention (a window of model.sliding_window "
        "tokens) or full_attention, one entry per layer (transformers' layer_types); null: sliding in even layers, "
        "full in odd ones, as GptOssConfig derives it")
    swiglu_alpha: PositiveFloat = Field(1.702, description="gpt_oss experts: the sigmoid's gain in their clamped "
                                        "SwiGLU, gate * sigmoid(alpha * gate) * (up + 1)")
    swiglu_limit: PositiveFloat = Field(7.0, description="gpt_oss experts: the gate clamped to at most this, the up "
                                        "projection to [-limit, limit], before their SwiGLU")
    rope_yarn: YarnScaling | None = Field(None, description="gpt_oss: YaRN rotary scaling (gpt-oss's factor 32 "
                                          "over 4,096 positions); null: plain rotary at rope_theta")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` (global index) has the MoE feed-forward: every ``moe.every``-th block,
        counting from the ``every``-th (``every: 2`` gives blocks 1, 3, 5, ...: GShard's every other layer);
        DeepSeek-V3: every block from ``dense_layers`` on."""
        if self.moe is not None and self.arch == "deepseek_v3":
            return layer >= self.dense_layers
        return self.moe is not None and layer % self.moe.every == self.moe.every - 1

    @property
    def mla_params(self) -> int:
        """One DeepSeek-V3 attention's parameters (its matrices and the two latent norms)."""
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = (self.d_model * self.n_heads * qk if self.q_lora_rank is None
             else self.q_lora_rank * (self.d_model + 1 + self.n_heads * qk))
        kv = (self.d_model * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
              + self.kv_lora_rank * self.n_heads * (self.qk_nope_head_dim + self.v_head_dim))
        return q + kv + self.n_heads * self.v_head_dim * self.d_model

    def layer_window(self, layer: int) -> int | None:
        """The attention window of block ``layer``: ``sliding_window`` for a ``sliding_attention`` layer (gpt-oss's
        ``layer_types``; every layer of another family), None (the whole causal prefix) for a full one."""
        if self.arch != "gpt_oss":
            return self.sliding_window
        return self.sliding_window if self.attention_types[layer] == "sliding_attention" else None

    @property
    def attention_types(self) -> list[str]:
        """gpt-oss's per-layer attention kinds: ``layer_types``, else sliding in even layers, full in odd ones."""
        return self.layer_types or [LAYER_TYPES[i % 2] for i in range(self.n_layers)]

    @property
    def gpt_oss_attention_params(self) -> int:
        """One gpt-oss attention's parameters: q, k, v, o with their biases and one sink logit per head."""
        q, kv = self.attention_width, self.kv_heads * self.head_size
        return 2 * self.d_model * (q + kv) + q + 2 * kv + self.d_model + self.n_heads

    @property
    def ffn_dim(self) -> int:
        """Feed-forward width; `d_ff` when given, else 4 * d_model (GPT) or Llama's SwiGLU rule (DeepSeek-V3's too)."""
        if self.d_ff is not None:
            return self.d_ff
        if self.arch in ("llama", "deepseek_v3", "gpt_oss"):
            return swiglu_hidden(self.d_model, self.multiple_of, self.ffn_dim_multiplier)
        return 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        """Key/value heads: `n_kv_heads` under grouped-query attention, else one per query head."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_size(self) -> int:
        """Each attention head's width: ``head_dim`` when given, else d_model / n_heads."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def attention_width(self) -> int:
        """The query (and attention output) width, n_heads * head_size: d_model unless ``head_dim`` says else."""
        return self.n_heads * self.head_size
