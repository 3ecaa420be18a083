"""Meta-device initialisation: build the model weightless, shard it, then give each rank only its own values.

Every rank builds the whole model on ``meta`` (no storage), applies the
pipeline cut, tensor parallelism and FSDP2 there, and only then allocates its
local shards (``to_empty``) and fills them (``materialize``). A shard's values
must equal the same slice of the single-process reference on every layout, so
they cannot come from a shared RNG stream (whose position would depend on
which parameters a rank builds). Instead every parameter has its own
generator, seeded from the job seed and the parameter's name in the unsplit
model (names are the same on every layout: layers are keyed by their global
index), and the family's ``init_parameter(name, shape, generator, cfg)`` hook
returns that parameter's FULL value; each rank copies out its slice (a
DTensor's local shard, found with DTensor's own
``compute_local_shape_and_global_offset``) and frees it. Peak host memory is
therefore the rank's shard plus the largest single tensor, not the model; the
cost is that every rank draws every full parameter it holds a piece of.

The reference uses the same path (``build_full``), so parity holds by
construction. What else is covered:

- LoRA adapters: named ``<linear>.lora_a.weight``/``lora_b.weight``, drawn by
  ``workers.model.lora.init_adapter``; a LoRA-wrapped base weight keeps its
  family name (``<linear>.base.weight`` is drawn as ``<linear>.weight``).
- QLoRA's NF4 bases: quantised per layer from that one full weight, then cut to
  the tensor-parallel shard ``NF4Linear.shard_`` recorded on meta.
- Buffers: a module holding buffers must define ``reset_buffers()`` (recompute
  them on its own device, e.g. a rotary table); one that does not is refused
  by name, since its values could not be rebuilt.
- Recompute wrappers (composable ``checkpoint``) and FSDP2 work on meta
  modules and keep parameter names; parameter offload runs after this, on the
  materialised shards, so it needs nothing here.

Not meta-initialised (built whole on the host, as before, then cut): a family
that registers no ``init_parameter`` hook, and LoRA fine-tuning from
``model.lora.base_checkpoint`` (the base is read as one full state dict).
Tied weights (one Parameter under two names) are drawn once, under their first
name, and tied again after ``to_empty`` (which would part them); FSDP2 itself
cannot shard a weight tied across two of its units.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from workers.contract.sections import LoraSection
from workers.model.config import ModelConfig
from workers.model.lora import ADAPTER_NAMES, apply_lora, init_adapter
from workers.model.names import parameter_generator
from workers.model.nf4 import NF4Linear
from workers.model.registry import ModelFamily, family

InitFn = Callable[[str, tuple, torch.Generator, ModelConfig], torch.Tensor]


def family_name(name: str) -> str:
    """The name ``name`` has in the plain (un-adapted) model: LoRA's ``.base`` hop removed."""
    return name.replace(".base.", ".")


def full_value(name: str, shape: tuple, seed: int, cfg: ModelConfig, init: InitFn) -> torch.Tensor:
    """The full initial value of parameter ``name`` (an adapter's, or the family's), on the host in float32."""
    generator = parameter_generator(seed, family_name(name))
    if name.rsplit(".", 2)[-2] in ADAPTER_NAMES:
        return init_adapter(name, shape, generator)
    value = init(family_name(name), shape, generator, cfg)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"init_parameter returned shape {tuple(value.shape)} for {name}, expected {tuple(shape)}")
    return value


def local_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that ``param`` holds on this rank (all of it for a plain tensor)."""
    if not isinstance(param, DTensor):
        return full
    shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]


def init_hook(fam: ModelFamily) -> InitFn | None:
    """The family's ``init_parameter`` hook, or None when it registers none (then the model is built whole)."""
    return fam.hook("init_parameter") if "init_parameter" in fam.hooks else None


@torch.no_grad()
def fill(module: nn.Module, seed: int, cfg: ModelConfig) -> None:
    """Write every parameter's (local share of its) initial value into ``module``, in place; rebuild buffers.

    One full tensor is alive at a time: drawn, sliced into the parameter, dropped.
    """
    init = family(cfg.arch).hook("init_parameter")
    for name, param in module.named_parameters():
        owner = module.get_submodule(name.rpartition(".")[0])
        rows = getattr(owner, "held_rows", None)  # a module holding some rows of a stacked parameter (Experts)
        weight = name.rpartition(".")[2]
        shape = tuple(param.shape) if rows is None else rows.full_shape(weight, tuple(param.shape))
        full = full_value(name, shape, seed, cfg, init)
        if rows is not None:
            full = rows.cut(weight, full, tuple(param.shape))
        target = param.to_local() if isinstance(param, DTensor) else param
        target.copy_(local_slice(full, param))
        del full
    for name, sub in module.named_modules():
        if isinstance(sub, NF4Linear):
            weight = f"{name}.weight"
            sub.requantize(full_value(weight, (sub.out_features, sub.in_features), seed, cfg, init))
        elif hasattr(sub, "reset_buffers"):
            sub.reset_buffers()
        elif next(sub.buffers(recurse=False), None) is not None:
            raise NotImplementedError(f"{name} ({type(sub).__name__}) holds buffers but has no reset_buffers(); "
                                      "meta-device init cannot rebuild them")


def materialize(module: nn.Module, seed: int, cfg: ModelConfig, device: torch.device) -> nn.Module:
    """Give a meta ``module`` (cut, TP- and FSDP-sharded as it will train) storage on ``device`` and its values."""
    tied = _tied_names(module)
    module.to_empty(device=device)  # allocates local shards only; FSDP2 re-points its shard storage (its _apply)
    for first, *others in tied:  # to_empty gives each name its own tensor: tie them again
        for other in others:
            owner, _, attr = other.rpartition(".")
            setattr(module.get_submodule(owner), attr, module.get_parameter(first))
    fill(module, seed, cfg)
    return module


def _tied_names(module: nn.Module) -> list[list[str]]:
    """Groups of names sharing one Parameter (e.g. tied embedding and head), first name first."""
    groups: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def build_full(cfg: ModelConfig, seed: int, lora: LoraSection | None = None,
               device: torch.device | str = "cpu") -> nn.Module:
    """The whole model (adapters too) with the values every layout's shards are cut from: the reference's build.

    Built on meta and materialised here, so a reference and a rank draw through exactly the same code; a
    family without ``init_parameter`` is built by its constructor from the seeded global stream instead.
    """
    meta = init_hook(family(cfg.arch)) is not None
    if not meta:
        torch.manual_seed(seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = family(cfg.arch).build(cfg)
        if lora:
            apply_lora(model, lora, seed)
    return materialize(model, seed, cfg, torch.device(device)) if meta else model.to(device)
