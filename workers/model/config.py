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
    arch: Literal["gpt"] = "gpt"  # the model family (see workers.model.registry)

    @property
    def ffn_dim(self) -> int:
        """Feed-forward width; `d_ff` when given, else the usual 4 * d_model."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

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
