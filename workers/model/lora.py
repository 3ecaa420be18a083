"""LoRA: low-rank adapters beside frozen Linear layers (Hu et al., 2021), QLoRA's NF4 base optional.

``y = base(x) + (alpha / rank) * B(A(dropout(x)))`` with ``A`` initialised like
any ``nn.Linear`` and ``B`` at zero, so step 0 is exactly the base model. Every
base parameter of the model is frozen (``requires_grad=False``: it gets no
gradient, so no optimizer state and no weight decay), only ``A`` and ``B``
train. ``A`` and ``B`` are ``nn.Linear`` children named ``lora_a``/``lora_b``
and the base Linear stays a child named ``base``, so tensor parallelism can
place each with PyTorch's own styles (``workers.parallel.lora_tp``) and a
checkpoint names them on every layout.

``targets`` are glob patterns over module names; a pattern matches a Linear
when it matches its whole name or a dotted suffix (``wq`` matches
``layers.0.attention.wq``, ``layers.0.*`` every Linear of layer 0).
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from workers.contract.sections import LoraSection
from workers.model.names import parameter_generator
from workers.model.nf4 import NF4Linear

ADAPTER_NAMES = ("lora_a", "lora_b")  # the child names meta init recognises as adapters (workers.model.meta_init)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, in_features: int, out_features: int, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base = base
        with torch.device("meta"):  # values come from init_adapter, per adapter name (see apply_lora)
            self.lora_a = nn.Linear(in_features, rank, bias=False)
            self.lora_b = nn.Linear(rank, out_features, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank
        self.adapting = True  # False inside `adapters_disabled`: the layer computes its base alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapting:
            return self.base(x)
        return self.base(x) + self.lora_b(self.lora_a(self.dropout(x))) * self.scaling

    def base_weight(self) -> torch.Tensor:
        """The frozen base weight in full precision (dequantized when it is stored as NF4)."""
        if isinstance(self.base, NF4Linear):
            return self.base.weight_nf4().dequantize()
        return self.base.weight.detach().float()

    def merged_weight(self) -> torch.Tensor:
        """``W + (alpha / rank) * B @ A``: the plain Linear weight this layer computes."""
        delta = self.lora_b.weight.detach().float() @ self.lora_a.weight.detach().float()
        return self.base_weight() + self.scaling * delta


@contextlib.contextmanager
def adapters_disabled(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Every ``LoRALinear`` of ``modules`` computes its base alone for the block: the model before fine-tuning,
    with no second copy of its weights (DPO's reference policy, as TRL's with PEFT's ``disable_adapter``)."""
    layers = [m for module in modules for m in module.modules() if isinstance(m, LoRALinear)]
    for layer in layers:
        layer.adapting = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapting = True


def init_adapter(name: str, shape: tuple, generator: torch.Generator) -> torch.Tensor:
    """An adapter's full initial value: ``A`` as ``nn.Linear``'s default (Kaiming-uniform, as in the paper),
    ``B`` zero so the adapted layer starts equal to its base."""
    if name.rsplit(".", 2)[-2] == "lora_b":
        return torch.zeros(shape)
    bound = 1 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def target_names(model: nn.Module, targets: list[str]) -> dict[str, list[str]]:
    """For each pattern, the names of the Linear modules of ``model`` it matches."""
    linears = [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    return {
        pattern: [n for n in linears if fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(n, "*." + pattern)]
        for pattern in targets
    }


def apply_lora(model: nn.Module, lora: LoraSection, seed: int | None = None) -> list[str]:
    """Freeze ``model`` and put adapters on the targeted Linears, in place; returns their names.

    On a meta model the adapters stay meta (``workers.model.meta_init`` fills them with the rest); on a
    materialised one they are drawn here from ``seed`` (default: the last ``torch.manual_seed``), per adapter
    name, so they equal a meta build's.
    """
    if lora.targets is None:
        raise ValueError("model.lora.targets is null; the driver's ModelSpec fills in the family's default: pass the "
                         "lora section of a validated JobSpec")
    names = sorted({n for found in target_names(model, lora.targets).values() for n in found},
                   key=[n for n, _ in model.named_modules()].index)
    if not names:
        raise ValueError(f"model.lora.targets {lora.targets} match no Linear layer")
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        base = NF4Linear(linear) if lora.quantize == "nf4" else linear
        adapted = LoRALinear(base, linear.in_features, linear.out_features, lora.rank, lora.alpha, lora.dropout)
        setattr(parent, child, adapted)
        if not linear.weight.is_meta:
            _draw_adapters(adapted, name, seed, linear.weight.device)
    freeze_base(model)
    return names


def _draw_adapters(layer: LoRALinear, name: str, seed: int | None, device: torch.device) -> None:
    """Materialise a real model's new adapters with their per-name values (the same draw as meta init)."""
    seed = torch.initial_seed() if seed is None else seed  # the last torch.manual_seed, as GPT(cfg) uses
    for child in ADAPTER_NAMES:
        linear = getattr(layer, child).to_empty(device=device)
        full = f"{name}.{child}.weight"
        with torch.no_grad():
            linear.weight.copy_(init_adapter(full, tuple(linear.weight.shape), parameter_generator(seed, full)))


def freeze_base(model: nn.Module) -> None:
    """Only adapter weights train; called again after tensor parallelism, whose styles re-create parameters."""
    adapters = {id(p) for mod in model.modules() if isinstance(mod, LoRALinear)
                for p in (*mod.lora_a.parameters(), *mod.lora_b.parameters())}
    for p in model.parameters():
        p.requires_grad_(id(p) in adapters)


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the plain model: adapters folded into their base weights, ``.base`` names undone."""
    out = {}
    adapted = {name: mod for name, mod in model.named_modules() if isinstance(mod, LoRALinear)}
    for name, mod in adapted.items():
        out[f"{name}.weight"] = mod.merged_weight()
        if getattr(mod.base, "bias", None) is not None:  # Qwen2's q/k/v: LoRA adapts the weight, the bias stays
            out[f"{name}.bias"] = mod.base.bias.detach().clone()
    for key, value in model.state_dict().items():
        owner = next((n for n in adapted if key.startswith(n + ".")), None)
        if owner is None:
            out[key] = value.detach().clone()
    return out

