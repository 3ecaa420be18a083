"""Optimizers, learning-rate schedules and global gradient clipping."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def build_optimizer(params, optim: dict, zero1_group=None) -> torch.optim.Optimizer:
    """The job's optimizer; with ``zero1_group`` its state is partitioned over that group (ZeRO-1)."""
    cls = OPTIMIZERS[optim["name"]]
    kwargs = {"lr": optim["lr"], "weight_decay": optim["weight_decay"]}
    if optim["name"] == "sgd":
        kwargs["momentum"] = optim["momentum"]
    else:
        kwargs["betas"] = tuple(optim["betas"])
    if zero1_group is not None:
        return ZeroRedundancyOptimizer(list(params), optimizer_class=cls, process_group=zero1_group, **kwargs)
    return cls(params, **kwargs)


def lr_lambda(optim: dict, total_steps: int):
    """Linear warmup, then constant or cosine decay to ``min_lr_ratio``."""
    warmup, floor = optim["warmup_steps"], optim["min_lr_ratio"]

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim["schedule"] == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def global_grad_norm(params: list[torch.nn.Parameter], pp_group=None) -> torch.Tensor:
    """L2 norm of all gradients of the job: DTensor shards are combined over their mesh, stages over ``pp_group``."""
    squares = torch.zeros((), dtype=torch.float32)
    for p in params:
        if p.grad is None:
            continue
        n = p.grad.float().norm()
        if isinstance(n, DTensor):
            n = n.full_tensor()
        squares = squares + n.to(squares.device) ** 2
    if pp_group is not None:
        dist.all_reduce(squares, group=pp_group)
    return squares.sqrt()


def clip_grads(params: list[torch.nn.Parameter], max_norm: float, pp_group=None) -> float:
    """Scale all gradients so their global norm is at most ``max_norm`` (0 disables).

    A per-tensor loop with a Python float rather than ``clip_grads_with_norm_``:
    TP without sequence parallelism mixes DTensor and plain gradients, which
    PyTorch's foreach kernels refuse.
    """
    norm = float(global_grad_norm(params, pp_group))
    coef = max_norm / (norm + 1e-6)
    if max_norm > 0 and coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
