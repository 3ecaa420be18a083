"""Any Hugging Face causal LM raymesh has no family of its own for (``model.arch: hf``): GPT-2, Phi, ...

Data parallelism and ZeRO need nothing from a model's architecture (seed 002, line 174: "only a wrapper is
written, and any network is parallelised without dissecting how it works"), so a ``transformers`` model trains
here as it is: ``AutoModelForCausalLM.from_config`` on the ``config.json`` of ``model.init_from``, its weights
read by each rank from the safetensors (``hf_io.load_hf_weights``, under the names ``transformers`` saved), FSDP2
over its decoder layers found generically (``blocks``: the ModuleList holding most parameters), and exported
back with ``transformers``' own ``save_pretrained`` (``write_hf_any``). What needs the architecture (tensor,
pipeline, context and expert parallelism, LoRA targets, chunked losses, document masks) is refused for it by
``orchestrator.spec.checks.hf_any``, naming the field and the fix.

The model is wrapped (``HFCausalLM``, its ``transformers`` model under ``lm``) so the trainer sees the interface
every family has: ``forward(tokens) -> logits``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workers.model.config import ModelConfig
from workers.model.names import plain_name
from workers.model.registry import ModelFamily, register

PREFIX = "lm."  # the wrapper's hop before every transformers parameter name
# config.json keys transformers writes about the file rather than the model; dropped before building
_BOOKKEEPING = ("transformers_version", "_name_or_path", "architectures")


def hf_model_config(config: dict[str, Any]):
    """``transformers``' config object for a ``config.json`` dict (its ``model_type`` picks the class)."""
    from transformers import AutoConfig

    kwargs = {k: v for k, v in config.items() if k not in ("model_type", *_BOOKKEEPING)}
    return AutoConfig.for_model(config["model_type"], **kwargs)


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM behind raymesh's model interface: tokens in, logits out."""

    loss_chunks = 1  # the head stays inside transformers' forward (train.loss_chunks > 1 is refused)
    compile_loss = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from transformers import AutoModelForCausalLM

        if cfg.hf_config is None:
            raise ValueError("model.arch 'hf' needs model.hf_config; set model.init_from to a Hugging Face directory")
        self.lm = AutoModelForCausalLM.from_config(hf_model_config(cfg.hf_config))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next-token logits of ``tokens`` [batch, seq] (no KV cache: training reads every position)."""
        return self.lm(input_ids=tokens, use_cache=False).logits

    def hf_key(self, name: str) -> str:
        """The ``transformers`` name of parameter ``name`` (wrapper hops and the ``lm.`` prefix dropped)."""
        return plain_name(name).removeprefix(PREFIX)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers, found without knowing the architecture: the ``nn.ModuleList`` holding the most
    parameters (GPT-2's ``transformer.h``, Phi's ``model.layers``). FSDP2 shards each as one unit under ZeRO-2/3,
    so only one layer is gathered whole at a time; recompute wraps each."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} holds no nn.ModuleList of layers; model.arch hf needs a decoder "
                         "whose layers are one (every transformers causal LM has one)")
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def model_fields(config: dict[str, Any], directory: str) -> dict[str, Any]:
    """The ``model:`` fields of a ``config.json`` of a family raymesh has no own for: the shape the planner
    estimates with, and the whole config the ranks build from. A model_type ``transformers`` does not know, or
    that has no causal-LM class, is refused naming it."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    kind = config.get("model_type")
    try:
        hf = hf_model_config(config)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"config.json model_type {kind!r} is not one transformers builds ({exc})") from None
    if type(hf) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"config.json model_type {kind!r} has no causal-LM class in transformers "
                         "(AutoModelForCausalLM); raymesh trains next-token models only")
    fields = {"arch": "hf", "hf_config": config}
    for field, attr in (("vocab_size", "vocab_size"), ("d_model", "hidden_size"), ("n_layers", "num_hidden_layers"),
                        ("n_heads", "num_attention_heads")):
        value = getattr(hf, attr, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"config.json gives no positive {attr} (read as {value!r}) for model.{field}; "
                             f"set it in {directory}/config.json")
        fields[field] = value
    ffn = getattr(hf, "intermediate_size", None) or getattr(hf, "n_inner", None)
    fields["d_ff"] = ffn if isinstance(ffn, int) and ffn > 0 else None
    return fields


def max_positions(config: dict[str, Any]) -> int | None:
    """The longest sequence the model's position table covers (GPT-2's n_positions), or None if it states none."""
    value = getattr(hf_model_config(config), "max_position_embeddings", None)
    return value if isinstance(value, int) else None


# files beside the weights transformers' save_pretrained does not write: the tokenizer's, copied as they are
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "added_tokens.json", "tokenizer.model", "chat_template.jinja")


def write_hf_any(model: HFCausalLM, out: str | Path, source: str | Path | None) -> Path:
    """``model`` (a checkpoint's weights loaded) as a Hugging Face directory, written by ``transformers``'
    ``save_pretrained`` itself (config.json, model.safetensors with ties as transformers keeps them, generation
    config), plus ``source``'s tokenizer files, so the export loads with ``from_pretrained`` as the source did."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.lm.save_pretrained(str(out), safe_serialization=True)
    for name in _TOKENIZER_FILES:
        if source is not None and (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, out / name)
    return out


register(ModelFamily(
    arch="hf",
    config=ModelConfig,
    build=HFCausalLM,
    recompute_targets={"full": ""},
    hooks={"blocks": "workers.model.hf_any:blocks"},
))
