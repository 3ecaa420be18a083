"""Server-side optimizers: ``torch.optim`` itself, one instance per chunk a shard holds.

Using PyTorch's own SGD/Adam/AdamW (single-tensor path, ``foreach=False``)
rather than re-deriving their update rules is what makes a BSP step equal to
the all-reduce data-parallel step: all four are elementwise, so running them on
a chunk of a tensor gives the same numbers as on the whole tensor.
"""

from __future__ import annotations

import torch

_CLASSES = {"sgd": torch.optim.SGD, "momentum": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def build(param: torch.Tensor, optim: dict) -> torch.optim.Optimizer:
    """``optim``: {name: sgd|momentum|adam|adamw, lr, weight_decay, betas, momentum}."""
    name = optim["name"]
    kwargs = {"lr": optim["lr"], "weight_decay": optim["weight_decay"], "foreach": False}
    if name in ("sgd", "momentum"):
        kwargs["momentum"] = optim["momentum"]
    else:
        kwargs["betas"] = tuple(optim["betas"])
    return _CLASSES[name]([param], **kwargs)


def step(opt: torch.optim.Optimizer, grad: torch.Tensor, lr: float) -> None:
    """One update of the optimizer's single parameter with ``grad`` at learning rate ``lr``."""
    group = opt.param_groups[0]
    group["lr"] = lr
    group["params"][0].grad = grad
    opt.step()
    group["params"][0].grad = None
