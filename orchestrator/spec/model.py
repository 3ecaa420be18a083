"""The `model:` section: the transformer's shape (and its LoRA/QLoRA fine-tuning, `model.lora`)."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from orchestrator.errors import SpecError
from orchestrator.spec.fields import PositiveFloat, PositiveInt, _divisors, _Section
from orchestrator.spec.lora import LoraSpec


class ModelSpec(_Section):
    """Transformer shape."""

    vocab_size: PositiveInt = 256
    d_model: PositiveInt = 64
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 4
    d_ff: PositiveInt | None = None
    seq_len: PositiveInt = 64
    positions: Literal["rotary", "learned"] = "rotary"
    norm_eps: PositiveFloat = 1e-5
    init_std: PositiveFloat = 0.02
    lora: LoraSpec | None = None  # LoRA/QLoRA fine-tuning; null: train every weight

    @property
    def ffn_dim(self) -> int:
        """Feed-forward width; `d_ff` when given, else the usual 4 * d_model."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @model_validator(mode="after")
    def _check_heads(self) -> ModelSpec:
        if self.d_model % self.n_heads:
            raise SpecError(
                "model.n_heads",
                self.n_heads,
                f"does not divide model.d_model={self.d_model}",
                f"pick n_heads from {_divisors(self.d_model)}, or make d_model a multiple of {self.n_heads}",
            )
        if self.positions == "rotary" and self.head_dim % 2:
            even = [h for h in _divisors(self.d_model) if (self.d_model // h) % 2 == 0]
            raise SpecError(
                "model.n_heads",
                self.n_heads,
                f"gives an odd head_dim d_model/n_heads = {self.d_model}/{self.n_heads} = {self.head_dim}, "
                "which rotary positions cannot rotate in pairs",
                f"pick n_heads from {even}, or set model.positions: learned",
            )
        return self
