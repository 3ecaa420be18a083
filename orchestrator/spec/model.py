"""The `model:` section: the transformer's shape (and its LoRA/QLoRA fine-tuning, `model.lora`)."""

from __future__ import annotations

from pydantic import model_validator

from orchestrator.errors import SpecError
from orchestrator.spec.fields import STRICT, _divisors, _Section
from orchestrator.spec.lora import LoraSpec
from workers.model.config import ModelConfig

MAX_LAYERS = 10_000


class ModelSpec(ModelConfig, _Section):
    """Transformer shape (fields in ``workers.model.config.ModelConfig``) and its fine-tuning."""

    model_config = STRICT  # ModelConfig's fields, validated as strictly as every other section's

    lora: LoraSpec | None = None  # LoRA/QLoRA fine-tuning; null: train every weight

    @model_validator(mode="after")
    def _check_depth(self) -> ModelSpec:
        if self.n_layers > MAX_LAYERS:
            raise SpecError("model.n_layers", self.n_layers, f"is above {MAX_LAYERS:,}: the deepest transformers "
                            "trained have a few hundred layers, and the planner and the pipeline builder walk "
                            "layers one by one", f"set model.n_layers to at most {MAX_LAYERS:,}")
        return self

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
