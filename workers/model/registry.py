"""The model registry: each family (``model.arch``) registers what the builder needs to build it.

A family is a config class, a constructor, and the per-family knowledge the
parallel builder applies from outside the model: how to cut a pipeline stage,
its tensor-parallel plan, where its blocks are and what recompute wraps in them, which Linear layers
LoRA adapts by default. The hooks are named as ``"module:function"`` and
imported when first used, so a family's package needs no import of the
parallel wrappers (which import the model package) and a second family
(Llama, an MoE GPT) plugs in by adding a package that calls ``register``,
without editing the builder.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workers.model.config import ModelConfig

if TYPE_CHECKING:  # the annotations only: the job-file checks import the registry without torch
    from torch import nn

# families shipped with raymesh: imported on first lookup, each registers itself
_BUILTIN = ("workers.model.gpt", "workers.model.llama", "workers.model.deepseek", "workers.model.gpt_oss",
            "workers.model.hf_any")

_FAMILIES: dict[str, ModelFamily] = {}


@dataclass(frozen=True)
class ModelFamily:
    """One model family.

    ``lora_targets`` are the Linear names LoRA adapts by default, ``recompute_targets`` what each recompute
    policy wraps inside every block ("" for the block itself), and ``hooks`` maps a builder step to the
    ``"module:function"`` doing it for this family:

    - ``cut_stage(model, stage, n_stages, split)``: a copy of the whole model holding only that pipeline stage
      (``split``: layer counts per stage, ``parallel.pp_split`` resolved; None for an even split);
    - ``tensor_parallel(stage, tp_mesh, sequence_parallel)``: shard a stage in place (through
      ``workers.parallel.tensor_parallel.apply_plan``, so LoRA/QLoRA layers follow their base's style);
    - ``blocks(stage)``: the stage's blocks in order: where ``recompute_targets`` are looked up (the
      checkpointing itself is generic, ``workers.parallel.recompute``) and FSDP2's units under ZeRO-2/3;
    - ``init_parameter(name, shape, generator, cfg) -> Tensor``: the FULL initial value of parameter ``name``
      (its name in the unsplit model), drawn only from ``generator`` (seeded from the job seed and ``name``),
      so every rank cuts its shard from the same values whatever the layout (``workers.model.meta_init``).
      Without it the model is built whole on every host before being cut (no meta-device init).
    """

    arch: str
    config: type[ModelConfig]
    build: Callable[[ModelConfig], nn.Module]
    lora_targets: tuple[str, ...] = ()
    recompute_targets: dict[str, str] = field(default_factory=dict)  # policy -> submodule of each block
    hooks: dict[str, str] = field(default_factory=dict)

    def hook(self, step: str) -> Callable:
        """The function this family uses for builder ``step``."""
        try:
            module, name = self.hooks[step].split(":")
        except KeyError:
            raise KeyError(f"model.arch {self.arch!r} registers no {step!r} hook (it has {sorted(self.hooks)}); "
                           f"add it to the family's register() call") from None
        return getattr(importlib.import_module(module), name)


def register(family: ModelFamily) -> ModelFamily:
    """Add a family under ``family.arch``; a second family with the same arch is an error, not an override."""
    known = _FAMILIES.get(family.arch)
    if known is not None and known != family:
        raise ValueError(f"model.arch {family.arch!r} is already registered; pick another arch name")
    _FAMILIES[family.arch] = family
    return family


def families() -> list[str]:
    """The registered architectures, sorted."""
    _load_builtin()
    return sorted(_FAMILIES)


def family(arch: str) -> ModelFamily:
    """The family registered as ``arch``; an unknown one names ``model.arch`` and what is registered."""
    _load_builtin()
    try:
        return _FAMILIES[arch]
    except KeyError:
        raise ValueError(f"model.arch {arch!r} is not a registered model family; pick one of "
                         f"{sorted(_FAMILIES)} (or register the family in workers.model.registry)") from None


def model_config(model: dict[str, Any]) -> ModelConfig:
    """The shape from a ``model:`` section dict (the worker dict also carries ``lora``, which is not shape).

    Parsed by the config class ``model.arch``'s family registered, so a family's own fields reach its builder.
    """
    cls = family(model.get("arch", ModelConfig.model_fields["arch"].default)).config
    return cls(**{k: v for k, v in model.items() if k in cls.model_fields})


def build_model(config: ModelConfig) -> nn.Module:
    """The whole model of ``config.arch`` (on the current default device, from the current RNG state)."""
    return family(config.arch).build(config)


def _load_builtin() -> None:
    for module in _BUILTIN:
        importlib.import_module(module)
