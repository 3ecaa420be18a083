"""Server-side optimizers: ``torch.optim`` itself, one instance per chunk a shard holds.

Using PyTorch's own SGD/Adam/AdamW (single-tensor path, ``foreach=False``)
rather than re-deriving their update rules is what makes a BSP step equal to
the all-reduce data-parallel step: all four are elementwise, so running them on
a chunk of a tensor gives the same numbers as on the whole tensor.
"""

from __future__ import annotations

import torch

_CLASSES = {"sgd": torch.optim.SGD, "momentum": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def decay_for(weight_decay: float, exclude: str | None, ndim: int) -> float:
    """The weight decay of a parameter of ``ndim`` dimensions: ``optim.weight_decay``, or 0 for the 1-D ones (norm
    weights, biases) under ``weight_decay_exclude`` (``exclude``) ``1d``, Megatron's and nanoGPT's rule (embeddings,
    2-D, decay). The one rule for the ranks' optimizers (``workers.optim.build.decay_groups``) and the shards'
    chunks, so every path decays the same parameters. None (a shard's dict written before the field) decays every
    parameter."""
    return 0.0 if exclude == "1d" and ndim < 2 else weight_decay


def dict_decay(optim: dict, ndim: int) -> float:
    """``decay_for`` of a shard's optimizer dict (``ParameterServerSpec.server_optim``)."""
    return decay_for(optim["weight_decay"], optim.get("weight_decay_exclude"), ndim)


def build(param: torch.Tensor, optim: dict, ndim: int) -> torch.optim.Optimizer:
    """``optim``: {name: sgd|momentum|adam|adamw, lr, weight_decay, weight_decay_exclude, betas, momentum};
    ``param`` is a flat chunk of a tensor of ``ndim`` dimensions, which picks its weight decay (``decay_for``)."""
    name = optim["name"]
    kwargs = {"lr": optim["lr"], "weight_decay": dict_decay(optim, ndim), "foreach": False}
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
