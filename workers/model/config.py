"""``ModelConfig``: a transformer's shape, declared once.

The orchestrator's ``model:`` section (``ModelSpec``) subclasses it to add
fine-tuning (``lora``) and the checks that name a field and its fix; the
workers build the model from it. ``arch`` picks the family in the model
registry (``workers.model.registry``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class RopeScaling(BaseModel):
    """Llama-3's rotary frequency scaling: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp
    between (the wavelength bounds are ``original_max_position_embeddings`` over the two frequency factors)."""

    model_config = ConfigDict(extra="forbid")

    factor: PositiveFloat = 8.0
    low_freq_factor: PositiveFloat = 1.0
    high_freq_factor: PositiveFloat = 4.0
    original_max_position_embeddings: PositiveInt = 8192


# fields only the Llama family reads; a GPT job setting one is refused rather than silently ignoring it
LLAMA_ONLY = ("n_kv_heads", "rope_theta", "rope_scaling", "multiple_of", "ffn_dim_multiplier", "tie_embeddings")


def swiglu_hidden(d_model: int, multiple_of: int, multiplier: float | None) -> int:
    """Llama's SwiGLU width: 2/3 of 4*d_model (three matrices cost what GPT's two do), times ``multiplier``,
    rounded up to ``multiple_of``."""
    hidden = int(2 * 4 * d_model / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


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
    norm_eps: PositiveFloat = 1e-5
    init_std: PositiveFloat = 0.02
    arch: Literal["gpt", "llama"] = "gpt"  # the model family (see workers.model.registry)
    # Llama-family fields (``LLAMA_ONLY``: a gpt refuses them, see orchestrator.spec.model)
    n_kv_heads: PositiveInt | None = None  # grouped-query attention: K/V heads (null: n_heads, plain multi-head)
    rope_theta: PositiveFloat = 10000.0  # rotary base
    rope_scaling: RopeScaling | None = None  # Llama-3 long-context frequency scaling; null: none
    multiple_of: PositiveInt = 256  # SwiGLU hidden size rounded up to a multiple of this (when d_ff is null)
    ffn_dim_multiplier: PositiveFloat | None = None  # SwiGLU hidden size scaled by this before rounding
    tie_embeddings: bool = False  # output head shares the token embedding's weight

    @property
    def ffn_dim(self) -> int:
        """Feed-forward width; `d_ff` when given, else 4 * d_model (GPT) or Llama's SwiGLU rule."""
        if self.d_ff is not None:
            return self.d_ff
        if self.arch == "llama":
            return swiglu_hidden(self.d_model, self.multiple_of, self.ffn_dim_multiplier)
        return 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        """Key/value heads: `n_kv_heads` under grouped-query attention, else one per query head."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def model_config(model: dict[str, Any]) -> ModelConfig:
    """The shape from a ``model:`` section dict (the worker dict also carries ``lora``, which is not shape).

    Parsed by the config class ``model.arch``'s family registered, so a family's own fields reach its builder.
    """
    from workers.model.registry import family  # the registry imports this module for ModelConfig

    cls = family(model.get("arch", ModelConfig.model_fields["arch"].default)).config
    return cls(**{k: v for k, v in model.items() if k in cls.model_fields})
