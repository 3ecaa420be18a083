"""Hugging Face Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and Mixtral checkpoints in and out: ``config.json`` <-> model
fields, names, sliced safetensors reads. All six are raymesh's one Llama (``workers.model.llama``) with the fields
``FAMILIES`` names, the last two with ``model.moe`` (``workers.model.hf_moe``: their keys, each expert's tensors
<-> raymesh's expert stacks); ``hf_model_type`` remembers which, so an export is the family it came from.

In: ``model.init_from: DIR`` (``config.json`` plus ``model.safetensors`` or shards listed in
``model.safetensors.index.json``). The model fields come from ``config.json`` (``config_fields``); the weights
are read after the model is cut, sharded and wrapped, each parameter's *local* box only
(``load_hf_weights``: safetensors' lazy ``get_slice`` on the offsets DTensor reports for this rank), so no rank
reads more than it keeps (an expert stack's box is the experts this rank keeps, each read from its own tensors).
Out: ``write_hf`` turns a full raymesh state dict into such a directory
(``raymesh export-hf``, ``raymesh export-merged --format hf``).

No conversion of the rotary layout is needed: raymesh's Llama rotates head halves, as Hugging Face's does
(``workers.model.llama``). Only the standard library, torch and safetensors are used here, so a rank needs no
``transformers``.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workers.model import deepseek, gpt_oss
from workers.model.config import HF_FAMILY_FIELDS, HF_MOE_TYPES, ModelConfig
from workers.model.hf_moe import ROUTER_BIAS, STACK, expert_name, moe_config, moe_fields, router_name
from workers.model.moe import HIDDEN_DIM, Experts
from workers.model.names import plain_name

CONFIG = "config.json"
DEEPSEEK = "deepseek_v3"  # model_type of DeepseekV3ForCausalLM: its own names and config (workers.model.deepseek)
GPT_OSS = "gpt_oss"  # model_type of GptOssForCausalLM: its own names and config (workers.model.gpt_oss)
OWN_FAMILIES = (DEEPSEEK, GPT_OSS)  # the Hugging Face families with a raymesh family of their own (model.arch)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# raymesh name -> Hugging Face name; "{}" is the layer index
_ENDS = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
         "output.weight": "lm_head.weight"}
_LAYER = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
          "attention.wq.bias": "self_attn.q_proj.bias", "attention.wk.bias": "self_attn.k_proj.bias",
          "attention.wv.bias": "self_attn.v_proj.bias", "attention.q_norm.weight": "self_attn.q_norm.weight",
          "attention.k_norm.weight": "self_attn.k_norm.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
          "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}


def hf_name(name: str, kind: str = "llama") -> str:
    """The Hugging Face name of a raymesh Llama parameter in family ``kind`` (``layers.3.attention.wq.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``, the same in all ``FAMILIES`` but an MoE router's); wrapper prefixes
    are dropped. An expert stack is several tensors: ``hf_tensors``, ``hf_moe.expert_name``."""
    name = plain_name(name)
    if kind == DEEPSEEK:
        return deepseek.hf_name(name)
    if kind == GPT_OSS:
        return gpt_oss.hf_name(name)
    if name in _ENDS:
        return _ENDS[name]
    router = router_name(name, kind)
    if router is not None:
        return router
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in _LAYER:
        raise KeyError(f"{name!r} has no Hugging Face Llama counterpart")
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"


# -- config.json ------------------------------------------------------------------------------------------------

def read_config(directory: str | Path) -> dict[str, Any]:
    """``config.json`` of a Hugging Face directory, the keys it leaves out filled with its family's defaults
    (``with_family_defaults``), so the spec, the loader and an export all read the model ``transformers`` builds."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise ValueError(f"model.init_from {str(directory)!r} has no {CONFIG}; point it at a Hugging Face model "
                         "directory (config.json and *.safetensors, as save_pretrained writes)")
    return with_family_defaults(json.loads(path.read_text()))


# transformers' (5.x) config-class defaults (``LlamaConfig``, ``MistralConfig``, ...) of the optional keys raymesh
# reads, per family: a config.json leaving one out builds that value in transformers, never Llama's. Written out
# here because a rank needs no transformers; tests/unit/test_hf_defaults.py checks them against the classes.
_SHARED_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
                    "attention_dropout": 0.0, "num_key_value_heads": None, "head_dim": None, "pad_token_id": None}
_QWEN_WINDOW = {"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28}
FAMILY_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, **_QWEN_WINDOW},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128, **_QWEN_WINDOW},
    # Qwen3MoeConfig saves num_experts as num_local_experts (its attribute_map); hf_moe reads either
    "qwen3_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "sliding_window": 4096,
                  "use_sliding_window": False, "norm_topk_prob": False, "decoder_sparse_step": 1,
                  "num_local_experts": 128},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072, "num_key_value_heads": 8,
                "sliding_window": None, "num_local_experts": 8, "router_jitter_noise": 0.0},
    GPT_OSS: gpt_oss.HF_DEFAULTS,
}


def with_family_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """``hf`` with the optional keys it leaves out set to its ``model_type``'s ``transformers`` defaults
    (``FAMILY_DEFAULTS``); a key given, even as null, is kept (transformers derives a null one as raymesh does). An
    unknown family is returned as it is (``config_fields`` refuses it by name)."""
    defaults = FAMILY_DEFAULTS.get(hf.get("model_type"))
    return hf if defaults is None else {**_SHARED_DEFAULTS, **defaults, **hf}


@dataclass(frozen=True)
class HfFamily:
    """What a Hugging Face family is to raymesh's one Llama: its ``model_type`` and ``architectures`` class, the
    model fields its weights always have (Qwen2's q/k/v biases, Qwen3's q/k norms), and the config.json keys it
    writes."""

    kind: str
    architecture: str
    written: dict[str, Any]  # family keys of config.json: sliding windows off, no o_proj/MLP biases

    @property
    def fields(self) -> dict[str, Any]:
        """The model fields its weights fix (``workers.model.config.HF_FAMILY_FIELDS``)."""
        return HF_FAMILY_FIELDS[self.kind]


_FAMILIES = (
    HfFamily("llama", "LlamaForCausalLM", {"attention_bias": False, "mlp_bias": False}),
    HfFamily("mistral", "MistralForCausalLM", {"sliding_window": None}),
    HfFamily("qwen2", "Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": None}),
    HfFamily("qwen3", "Qwen3ForCausalLM", {"attention_bias": False, "use_sliding_window": False,
                                           "sliding_window": None}),
    HfFamily("qwen3_moe", "Qwen3MoeForCausalLM", {"attention_bias": False, "use_sliding_window": False,
                                                   "sliding_window": None}),
    HfFamily("mixtral", "MixtralForCausalLM", {"sliding_window": None}),
)
FAMILIES = {family.kind: family for family in _FAMILIES}


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """raymesh ``model:`` fields from a Hugging Face ``FAMILIES`` ``config.json`` (seq_len is the job's, not taken;
    a window every layer uses is ``sliding_window``, others are checked against it by ``check_sliding_window``);
    ``moe`` is None for a dense family, so a
    job's ``model.moe`` over a dense checkpoint is refused as a disagreement.

    Raises ``ValueError`` naming the config key for what raymesh's Llama cannot represent."""
    kind = hf.get("model_type")
    if kind == DEEPSEEK:
        return deepseek.config_fields(hf)
    if kind == GPT_OSS:
        return gpt_oss.config_fields(with_family_defaults(hf))
    if kind not in FAMILIES:
        raise ValueError(f"config.json model_type {kind!r} is not supported; raymesh reads Hugging Face "
                         f"{', '.join(repr(k) for k in FAMILIES)} checkpoints "
                         f"({', '.join(f.architecture for f in FAMILIES.values())}), 'deepseek_v3' "
                         "(DeepseekV3ForCausalLM, model.arch deepseek_v3) and 'gpt_oss' (GptOssForCausalLM, "
                         "model.arch gpt_oss)")
    hf = with_family_defaults(hf)
    _check_sizes(hf)
    _check_unsupported(hf)
    heads = hf["num_attention_heads"]
    rope = rope_settings(hf)
    return {
        "arch": "llama", "vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"], "n_heads": heads,
        "n_kv_heads": hf["num_key_value_heads"] or heads, "head_dim": _head_dim(hf),
        "d_ff": hf["intermediate_size"], "norm_eps": hf["rms_norm_eps"],
        "rope_theta": rope["rope_theta"], "rope_scaling": _rope_scaling(rope),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "positions": "rotary",
        "pad_token_id": hf.get("pad_token_id"), "hf_model_type": kind, **FAMILIES[kind].fields,
        "moe": None, **(moe_fields(hf) if kind in HF_MOE_TYPES else {}), "sliding_window": uniform_window(hf),
    }


# config.json sizes every checkpoint of a family gives; those it may leave out are checked only when given, and the
# nullable ones (transformers derives them from the heads then) only when not null
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
FAMILY_SIZE_KEYS = {"qwen3_moe": ("num_experts_per_tok", "moe_intermediate_size"),
                    "mixtral": ("num_local_experts", "num_experts_per_tok")}
OPTIONAL_SIZE_KEYS = ("num_key_value_heads", "head_dim", "num_experts", "decoder_sparse_step")
NULLABLE_SIZE_KEYS = ("num_key_value_heads", "head_dim")


def _check_sizes(hf: dict[str, Any]) -> None:
    """Refuse a missing, null or non-positive size, naming the key: a null one would otherwise fall back to
    raymesh's default (a ``d_ff`` or expert width the weights do not have, found only once the ranks read them) or
    fail deep in the arithmetic with a bare ``TypeError``."""
    required = (*SIZE_KEYS, *FAMILY_SIZE_KEYS.get(hf["model_type"], ()))
    for key in required:
        if key not in hf:
            raise ValueError(f"config.json has no {key}, which transformers needs too; add the checkpoint's {key}")
    for key in (*required, *OPTIONAL_SIZE_KEYS):
        value = hf.get(key, 1)
        if value is None and key in NULLABLE_SIZE_KEYS:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.json {key} {value!r} is not a positive whole number; set it to the "
                             "checkpoint's (as its weights' shapes give it)")


def _head_dim(hf: dict[str, Any]) -> int | None:
    """config.json's ``head_dim`` when it is not hidden_size / num_attention_heads (Qwen3-0.6B: 128, not 64); None
    otherwise, so the job's fields read as a plain Llama's."""
    given, heads, hidden = hf.get("head_dim"), hf["num_attention_heads"], hf["hidden_size"]
    return None if given is None or (hidden % heads == 0 and given == hidden // heads) else given


def _check_unsupported(hf: dict[str, Any]) -> None:
    """Refuse, naming the key and its fix, a config.json setting raymesh's Llama does not compute."""
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"config.json {key}: true is not supported (raymesh's {hf['model_type']} has no "
                             f"{'o_proj or MLP' if key == 'attention_bias' else 'MLP'} biases); it needs a "
                             f"checkpoint trained with {key}: false")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act {hf['hidden_act']!r} is not supported (SwiGLU uses silu)")
    if hf.get("attention_dropout"):
        raise ValueError(f"config.json attention_dropout {hf['attention_dropout']} is not supported (raymesh's Llama "
                         "has no attention dropout; transformers applies it in training); set attention_dropout: "
                         "0.0 in config.json to fine-tune without it")


# the families whose ``sliding_window`` applies whenever it is set (no ``use_sliding_window`` switch)
WINDOWED_ALWAYS = ("mistral", "mixtral")


def sliding_window(hf: dict[str, Any]) -> int | None:
    """The attention window ``transformers`` applies to some layer of this config.json, or None when every layer
    attends to the whole causal prefix: Mistral's (and Mixtral's) ``sliding_window`` when set; Qwen's only under
    ``use_sliding_window: true``, and then (Qwen2/Qwen3) only if some layer is a ``sliding_attention`` one
    (``layer_types``, else the layers from ``max_window_layers`` on, as Qwen2Config/Qwen3Config derive them);
    Qwen3-MoE windows every layer."""
    hf = with_family_defaults(hf)
    kind = hf.get("model_type")
    if kind in WINDOWED_ALWAYS:
        return hf.get("sliding_window")
    if kind not in ("qwen2", "qwen3", "qwen3_moe") or not hf.get("use_sliding_window"):
        return None
    if kind == "qwen3_moe":
        return hf["sliding_window"]
    return hf["sliding_window"] if "sliding_attention" in _layer_types(hf) else None


def _layer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's attention in a Qwen2/Qwen3 config.json: ``layer_types``, else ``sliding_attention`` from
    ``max_window_layers`` on, as Qwen2Config/Qwen3Config derive them."""
    hf = with_family_defaults(hf)
    return hf.get("layer_types") or ["sliding_attention" if i >= hf["max_window_layers"] else "full_attention"
                                     for i in range(hf["num_hidden_layers"])]


def uniform_window(hf: dict[str, Any]) -> int | None:
    """The sliding window of a config.json that windows every layer alike (``model.sliding_window``), else None:
    Mistral's and Mixtral's always, Qwen3-MoE's under ``use_sliding_window``, Qwen2/Qwen3's when no layer is a
    ``full_attention`` one."""
    window = sliding_window(hf)
    if window is None or hf["model_type"] in (*WINDOWED_ALWAYS, "qwen3_moe"):
        return window
    return window if "full_attention" not in _layer_types(hf) else None


def check_sliding_window(hf: dict[str, Any], seq_len: int) -> None:
    """Refuse a sliding window raymesh cannot compute at the job's ``seq_len``: one some layers use and others
    not (a Qwen ``max_window_layers`` or ``layer_types`` mix), when it is shorter than ``seq_len``. A window every
    layer uses is ``model.sliding_window``; one of at least ``seq_len`` tokens cuts nothing (``transformers``
    masks keys ``window`` or more positions back), so the model computes exactly what ``transformers`` does."""
    window = sliding_window(hf)
    if window is not None and window < seq_len and uniform_window(hf) is None:
        full = [i for i, kind in enumerate(_layer_types(hf)) if kind == "full_attention"]
        raise ValueError(f"config.json use_sliding_window true makes some layers look back only {window} tokens, "
                         f"less than model.seq_len {seq_len}, while layers {full} attend to the whole prefix, and "
                         f"raymesh windows every layer alike or none (model.sliding_window); set model.seq_len to at "
                         f"most {window}, or window every layer (layer_types all sliding_attention)")


def rope_settings(hf: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings ``transformers`` resolves from ``config.json`` (v5,
    ``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``), so the same file gives the same model: a v4
    ``rope_scaling`` replaces ``rope_parameters`` whole; a ``rope_theta`` missing there comes from the top level,
    else the family's default (``FAMILY_DEFAULTS``: Mixtral's 1e6); a scaled type missing
    ``original_max_position_embeddings`` takes ``max_position_embeddings``."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    given = hf.get(key) or {}
    if not isinstance(given, dict):
        raise ValueError(f"config.json {key} {given!r} is not an object of rotary settings; write it as "
                         '{"rope_type": ..., ...} (as transformers saves it), or null for plain rotary positions')
    rope = dict(given)
    rope.setdefault("rope_theta", hf["rope_theta"])
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] == "llama3":
        rope.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
    return rope


def _rope_scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    """raymesh's ``rope_scaling`` from resolved settings (``rope_settings``); a llama3 key missing is named."""
    kind = rope["rope_type"]
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"config.json rope type {kind!r} is not supported; raymesh implements 'default' and "
                         "'llama3' rotary scaling")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in rope]
    if missing:
        raise ValueError(f"config.json llama3 rope settings lack {', '.join(missing)}; transformers needs them "
                         "too: add them to rope_scaling (or rope_parameters)")
    return {k: rope[k] for k in keys}


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` ``transformers`` builds a model of ``cfg``'s family (``hf_model_type``: its
    ``*ForCausalLM``) and shape from: the rotary settings both as v5's ``rope_parameters`` and as v4's
    ``rope_theta``/``rope_scaling``; the sliding window ``model.sliding_window`` says (``carried_config`` brings
    back a source's own keys)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = None
    if cfg.rope_scaling is not None:
        scaling = {"rope_type": "llama3", **cfg.rope_scaling.model_dump()}
        rope = {**rope, **scaling}
    return {
        "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
        "architectures": [FAMILIES[cfg.hf_model_type].architecture], "model_type": cfg.hf_model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size, "intermediate_size": cfg.ffn_dim,
        "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope, "max_position_embeddings": cfg.seq_len,
        "pad_token_id": cfg.pad_token_id, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "initializer_range": cfg.init_std, "torch_dtype": "float32", **FAMILIES[cfg.hf_model_type].written,
        **(moe_config(cfg) if cfg.hf_model_type in HF_MOE_TYPES else {}), **window_config(cfg),
    }


def window_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json keys that make ``transformers`` window every layer as ``model.sliding_window`` does
    (nothing without a window). Llama's config has no window: such a model is refused, naming the fix."""
    window, kind = cfg.sliding_window, cfg.hf_model_type
    if window is None:
        return {}
    if kind in WINDOWED_ALWAYS:
        return {"sliding_window": window}
    if kind == "llama":
        raise ValueError(f"model.sliding_window {window} cannot be written as a Hugging Face llama checkpoint "
                         "(LlamaForCausalLM has no window); set model.hf_model_type: mistral")
    return {"use_sliding_window": True, "sliding_window": window, "max_window_layers": 0,
            "layer_types": ["sliding_attention"] * cfg.n_layers}


# -- weights in -------------------------------------------------------------------------------------------------

def weight_files(directory: str | Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it (sharded via the index, or one file)."""
    root = Path(directory)
    if (root / INDEX).is_file():
        try:
            index = json.loads((root / INDEX).read_text())["weight_map"]
            return {name: root / file for name, file in index.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"model.init_from {root / INDEX} is not a safetensors index (a weight_map of tensor "
                             f"names to files: {type(exc).__name__} {exc}); fix: copy the checkpoint's index "
                             "again") from None
    if (root / SINGLE).is_file():
        with safe_file(root / SINGLE) as f:
            return {name: root / SINGLE for name in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    raise ValueError(f"model.init_from {str(root)!r} holds neither {INDEX} nor {SINGLE}")


def safe_file(path: Path):
    """``safe_open`` of ``path``; one that is cut short, missing or no safetensors file is refused by name
    (safetensors checks on open that its header's offsets cover the file exactly)."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own SafetensorError (an Exception), or an OSError
        raise ValueError(f"model.init_from {path} cannot be read as safetensors ({exc}); fix: download or copy "
                         "the checkpoint's files again") from None


def local_box(param: torch.Tensor) -> tuple[torch.Tensor, list[slice]]:
    """The tensor this rank stores for ``param`` and the global slices it covers (all of it when not a DTensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.data, [slice(0, n) for n in param.shape]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), [slice(o, o + n) for o, n in zip(offset, shape, strict=True)]


def load_hf_weights(model: nn.Module, directory: str | Path) -> list[str]:
    """Fill every parameter of ``model`` (a whole model, or one rank's cut, sharded and wrapped stage) with
    its own slice of the checkpoint; returns the Hugging Face names read. An expert stack reads only the experts
    this rank keeps (its box's rows, from ``Experts.first`` under expert parallelism), each from its own tensors.
    A tensor missing from the checkpoint, of another shape or of a dtype that is no float's, is an error naming it;
    so is a slice holding NaN or inf, naming its file: checked here, on the slice each rank reads (the driver reads
    only the headers, ``check_hf_weights``), so bad weights end the job at start instead of as bad batches."""
    reader = _Reader(directory)
    try:
        with torch.no_grad():
            for key, target, read in _reads(model, reader):
                values = read()
                if not torch.isfinite(values).all():
                    raise ValueError(f"model.init_from {reader.files[key]} holds non-finite values (NaN or inf) in "
                                     f"tensor {key}; fix: use an intact copy of the checkpoint (these weights would "
                                     "train NaN losses from the first step)")
                target.copy_(values.to(target.dtype))
    finally:
        reader.handles.clear()
    return reader.read


def check_hf_weights(model: nn.Module, directory: str | Path) -> list[str]:
    """Without reading a weight: every tensor ``model`` (built on the meta device) takes from the Hugging Face
    directory is there, of its shape and of a float dtype, in files whose headers cover them whole (a file cut
    short is refused by safetensors on open), and a tied model's files hold no head of their own. Returns the
    names it would read. What only the values can tell (NaN, inf) ``load_hf_weights`` checks in the ranks."""
    reader = _Reader(directory)
    try:
        for path in dict.fromkeys(reader.files.values()):
            reader.handle(path)
        names = [key for key, _, _ in _reads(model, reader)]
        _check_untied_head(reader, model)
    finally:
        reader.handles.clear()
    return names


def _reads(model: nn.Module, reader: _Reader):
    """(Hugging Face name, the tensor it fills, a call that reads its values) for every tensor ``model``'s
    parameters take from the checkpoint, each refused by ``reader.slice`` when missing or not what the model needs."""
    kind, stacks = read_config(reader.directory).get("model_type"), _expert_stacks(model)
    # a model.arch hf model keeps transformers' own names (workers.model.hf_any); raymesh's Llama maps its own
    key_of = getattr(model, "hf_key", None) or (lambda name: hf_name(name, kind))
    if kind == GPT_OSS:  # fused, interleaved gate/up experts: workers.model.gpt_oss
        yield from gpt_oss.hf_reads(model, reader, plain_name, local_box)
        return
    if kind == DEEPSEEK:
        yield from _deepseek_extras(model, reader)
    for name, param in model.named_parameters():
        local, box = local_box(param)
        if kind == DEEPSEEK and SHARED.fullmatch(plain_name(name)):
            continue  # read whole by _deepseek_extras
        if name not in stacks:
            key = key_of(name)
            source = reader.slice(key, name, param.shape)
            yield key, local, lambda source=source, box=tuple(box): source[box]
            continue
        yield from _expert_reads(name, param, stacks[name], local, box, kind, reader)


def _expert_reads(name: str, param, experts: Experts, local: torch.Tensor, box: list[slice], kind, reader):
    """``_reads`` of an expert stack [E, a, b]: each kept expert from its own [b, a] tensor; under expert tensor
    parallelism (``parallel.expert_tp``) only this tp rank's hidden units of it (``HeldRows``)."""
    rows, cols, width = box
    held, weight = experts.held_rows, name.rpartition(".")[2]
    full = held.full_shape(weight, tuple(param.shape))
    if held.hidden_full is not None:  # the hidden dim's slice starts at this tp rank's first unit
        shift = held.hidden_start
        if HIDDEN_DIM[weight] == 2:
            width = slice(width.start + shift, width.stop + shift)
        else:
            cols = slice(cols.start + shift, cols.stop + shift)
    for i, expert in enumerate(range(experts.first + rows.start, experts.first + rows.stop)):
        key = expert_name(plain_name(name), kind, expert)
        source = reader.slice(key, name, (full[2], full[1]))
        yield key, local[i], lambda source=source, box=(width, cols): source[box].t()


# safetensors dtypes a weight is read from (cast to the model's); an integer, bool or float8 tensor under a float
# weight's name is a quantized checkpoint's packed values (their scales live in other tensors) or not weights at all
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


class _Reader:
    """Lazy safetensors slices of a Hugging Face directory, each file opened once; ``read`` lists the names read."""

    def __init__(self, directory: str | Path):
        self.directory, self.files, self.handles, self.read = directory, weight_files(directory), {}, []

    def handle(self, path: Path):
        """The open safetensors file ``path`` (``safe_file``)."""
        if path not in self.handles:
            self.handles[path] = safe_file(path)
        return self.handles[path]

    def slice(self, key: str, name: str, shape: tuple[int, ...]):
        """The lazy slice of tensor ``key`` (raymesh's ``name``), refused unless it is ``shape`` on disk and of a
        float dtype."""
        if key not in self.files:
            raise ValueError(f"model.init_from {str(self.directory)!r} has no tensor {key!r} (for {name})")
        path = self.files[key]
        source = self.handle(path).get_slice(key)
        if list(source.get_shape()) != list(shape):
            raise ValueError(f"model.init_from {key} has shape {source.get_shape()}, the model's {name} needs "
                             f"{list(shape)}: config.json and the weights disagree")
        if source.get_dtype() not in FLOAT_DTYPES:
            raise ValueError(f"model.init_from {path} holds tensor {key} as {source.get_dtype()}, not as a float "
                             f"({', '.join(FLOAT_DTYPES)}): cast, its values would not be the weights (a quantized "
                             "checkpoint keeps packed integers and their scales apart); fix: use the checkpoint's "
                             "unquantized (float) release")
        self.read.append(key)
        return source


HEAD, EMBEDDING = _ENDS["output.weight"], _ENDS["tok_embeddings.weight"]
_ROWS_AT_ONCE = 4096  # rows of the head and the embedding compared at a time


def _check_untied_head(reader: _Reader, model: nn.Module) -> None:
    """A model built with tied embeddings (``tie_word_embeddings: true``) has no head of its own, so a
    ``lm_head.weight`` in the files that is not the embedding would be dropped without a word. Compared a block of
    rows at a time, stopping at the first that differs: a distinct head is found in the first block."""
    has_head = any(plain_name(n) == "output.weight" for n, _ in model.named_parameters())
    if hasattr(model, "hf_key") or has_head or HEAD not in reader.files or EMBEDDING not in reader.files:
        return
    head, embedding = (reader.handle(reader.files[k]).get_slice(k) for k in (HEAD, EMBEDDING))
    rows = head.get_shape()[0]
    same = head.get_shape() == embedding.get_shape() and all(
        torch.equal(head[i:i + _ROWS_AT_ONCE], embedding[i:i + _ROWS_AT_ONCE]) for i in range(0, rows, _ROWS_AT_ONCE))
    if not same:
        raise ValueError(f"model.init_from {reader.files[HEAD]} holds {HEAD}, a head other than {EMBEDDING}, but "
                         f"{reader.directory}/{CONFIG} says tie_word_embeddings: true, so the model would share the "
                         f"embedding and drop that head; fix: set tie_word_embeddings: false in {CONFIG} if the head "
                         f"is the model's own, or remove {HEAD} from the files if the embedding is")


SHARED = re.compile(r"(?:layers|mtp)\.(\d+)\.feed_forward\.shared\.(w[123])")


def _deepseek_extras(model: nn.Module, reader: _Reader):
    """A DeepseekV3 checkpoint's tensors that are no parameter's box: each MoE layer's shared-experts MLP (one
    Linear per matrix on disk, a stack [n, a, b] here, read whole: it is replicated) and the routers' balancing
    bias (``e_score_correction_bias``, a buffer)."""
    for name, param in model.named_parameters():
        if SHARED.fullmatch(plain_name(name)):
            local, box = local_box(param)
            plain = plain_name(name)
            key = deepseek.shared_key(plain)
            source = reader.slice(key, name, deepseek.shared_shape(tuple(param.shape), plain))
            yield key, local, lambda source=source, plain=plain, box=tuple(box), n=param.shape[0]: (
                deepseek.shared_stack(source[:], plain, n)[box])
    for name, buffer in model.named_buffers():
        if ROUTER_BIAS.fullmatch(plain_name(name)):
            key = hf_name(name, DEEPSEEK)
            source = reader.slice(key, name, buffer.shape)
            yield key, buffer, lambda source=source: source[:]


def _expert_stacks(model: nn.Module) -> dict[str, Experts]:
    """Each expert stack's parameter name in ``model`` -> the ``Experts`` holding it (its rows and hidden units)."""
    return {f"{prefix}.{name}": module for prefix, module in model.named_modules()
            if isinstance(module, Experts) for name, _ in module.named_parameters(recurse=False)}


# -- weights out ------------------------------------------------------------------------------------------------

# config.json keys of a source checkpoint that raymesh's model fields do not hold, carried into its export
CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
# an MoE's aux-loss settings, carried where the source has them: raymesh does not map them (``workers.model.hf_moe``),
# but transformers' own training of the export reads them
AUX_LOSS_KEYS = ("router_aux_loss_coef", "output_router_logits")
# a Mistral's or Qwen's sliding-window keys, carried where the source has them: accepted only where the window cuts
# nothing at the job's seq_len (``check_sliding_window``), the window stays the model's at longer contexts
WINDOW_KEYS = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")
# files beside a source checkpoint's weights that say how its ids are text and how it generates: copied as they are
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
              "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def write_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, out: str | Path,
             source: str | Path | None = None, vocab: int | None = None) -> Path:
    """Write a full raymesh Llama state dict as a Hugging Face directory: ``config.json`` + ``model.safetensors``.
    A tied head is written once, as the embedding (``tie_word_embeddings`` says so), unless a merged adapter made it
    another matrix (``written_config``). With ``source`` (the run's ``model.init_from``) its special-token ids,
    context length, tokenizer and generation files come along, so the export is the same model to ``transformers``'
    tokenizer and ``generate`` as the checkpoint it came from. With ``vocab`` (the job's ``model.vocab_size``) the
    rows tp padded the vocabulary with are left out (``unpadded``)."""
    from safetensors.torch import save_file

    state, cfg = unpadded(state, cfg, vocab)
    cfg = written_config(state, cfg)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.arch == DEEPSEEK:  # its names and its balancing bias (a checkpoint tensor there): workers.model.deepseek
        plain = {plain_name(k): v.detach().cpu() for k, v in state.items()
                 if not (cfg.tie_embeddings and plain_name(k) == "output.weight")}
        tensors, config = deepseek.to_hf_state(plain), deepseek.hf_config(cfg)
    elif cfg.arch == GPT_OSS:
        plain = {plain_name(k): v.detach().cpu() for k, v in state.items()
                 if not (cfg.tie_embeddings and plain_name(k) == "output.weight")}
        tensors, config = gpt_oss.to_hf_state(plain), gpt_oss.hf_config(cfg)
    else:
        tensors = {key: value for name, tensor in written_weights(state, cfg)
                   for key, value in hf_tensors(name, tensor.detach().cpu(), cfg.hf_model_type).items()}
        config = hf_config(cfg)
    save_file(tensors, str(out / SINGLE), metadata={"format": "pt"})
    if source is not None:
        config = carried_config(config, read_config(source), cfg.seq_len)
        for name in SIDE_FILES:
            if (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, out / name)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def hf_tensors(name: str, value: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of one raymesh parameter in family ``kind``: itself under its name, or an expert
    stack [E, a, b] as E ``nn.Linear`` weights [b, a] (``hf_moe.expert_name``), as the published checkpoints hold
    them and ``transformers`` fuses on load."""
    plain = plain_name(name)
    if STACK.fullmatch(plain):
        return {expert_name(plain, kind, e): value[e].t().contiguous() for e in range(value.shape[0])}
    return {hf_name(plain, kind): value.contiguous()}


def written_weights(state: dict[str, torch.Tensor], cfg: ModelConfig):
    """``state``'s entries a Hugging Face directory holds: a tied head is the embedding, and an MoE router's
    balancing ``bias`` buffer (zero unless ``bias_balancing``, which these families cannot hold) is left out."""
    for name, tensor in state.items():
        plain = plain_name(name)
        if cfg.tie_embeddings and plain == "output.weight":
            continue
        if ROUTER_BIAS.fullmatch(plain):
            if tensor.any():
                raise ValueError(f"{plain} is model.moe.bias_balancing's learnt bias, which a Hugging Face "
                                 f"{cfg.hf_model_type} checkpoint cannot hold; export a run without bias_balancing")
            continue
        yield name, tensor


def unpadded(state: dict[str, torch.Tensor], cfg: ModelConfig,
             vocab: int | None) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """``state`` and ``cfg`` cut to the first ``vocab`` embedding and head rows. Under tp the ranks build
    ``model.vocab_size`` rounded up to a multiple of tp (``JobSpec.padded_vocab_size``); ids past the job's vocabulary
    never occur, and an export that kept their rows would not match its tokenizer in ``transformers``."""
    if vocab is None or vocab == cfg.vocab_size:
        return state, cfg
    rows = {"tok_embeddings.weight", "output.weight"}
    state = {k: v[:vocab] if plain_name(k) in rows else v for k, v in state.items()}
    return state, cfg.model_copy(update={"vocab_size": vocab})


def written_config(state: dict[str, torch.Tensor], cfg: ModelConfig) -> ModelConfig:
    """``cfg`` untied when ``state``'s head is not its embedding: a LoRA adapter on a tied model's ``output``,
    merged, changes the head alone, and a tied export would drop the merged head (``transformers`` would compute
    other logits than the checkpoint's model)."""
    head, embedding = state.get("output.weight"), state.get("tok_embeddings.weight")
    if not cfg.tie_embeddings or head is None or embedding is None or torch.equal(head, embedding):
        return cfg
    return cfg.model_copy(update={"tie_embeddings": False})


def carried_config(config: dict[str, Any], source: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """``config`` with the source's ``CARRIED_KEYS``, ``WINDOW_KEYS`` and ``AUX_LOSS_KEYS``; the context length is the
    source's unless the run trained on longer sequences (the job's ``seq_len`` is only what fine-tuning used, not
    what the model can take)."""
    carried = {**config, **{k: source[k] for k in (*CARRIED_KEYS, *WINDOW_KEYS, *AUX_LOSS_KEYS) if k in source}}
    carried["max_position_embeddings"] = max(carried["max_position_embeddings"], seq_len)
    return carried
