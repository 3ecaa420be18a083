"""Adafactor (Shazeer & Stern 2018) on sharded parameters, step for step PyTorch's ``torch.optim.Adafactor``.

Why our own beside PyTorch's: its factored second moment keeps, per matrix, the running mean of g² over each
row (``row_var``) and over each column (``col_var``), and estimates the full second moment as
``row_var @ col_var / mean(row_var)``; its step size is scaled by the parameter's RMS and clipped by the
update's RMS. Every one of those is a statistic of the *whole* matrix. A shard of FSDP2 (ZeRO-2/3), of ZeRO-1's
distributed optimizer or of tensor parallelism sees some rows or some columns only, so PyTorch's optimizer
stepping a local shard would divide by the wrong means and move the wrong distance.

Here each statistic is the local sum all-reduced (SUM) over the process groups of the mesh dimensions that shard
the tensor dimension it sums over (the rule ``workers.optim.sm3`` uses for its maxima):

* a row's mean of g² sums the last dimension: over the groups sharding the last dimension;
* a column's mean sums the second-to-last: over the groups sharding that one;
* ``mean(row_var)``, the parameter's RMS and the update's RMS sum every entry: over every sharding group;

and is divided by the *global* size. Each rank then holds the exact rows and columns of the full statistics its
shard needs, so the step equals one process's to float rounding (the order of the sums differs). The cost is
three small all-reduces per matrix and sharding mesh dimension (rows + cols + 3 floats), per step.

``row_var`` and ``col_var`` are kept as DTensors of their global shapes (``[..., rows, 1]`` and
``[..., 1, cols]``), placed like the parameter except along the dimension they were summed over (Replicate
there), so DCP saves them under one global shape and reshards them on load to any layout. On a plain tensor
the optimizer is PyTorch's loop exactly (``build_optimizer`` picks PyTorch's when nothing is sharded).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _placed_like(grad: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``grad`` placed as ``p`` is: under tensor parallelism a gradient can arrive replicated or partial where its
    parameter is sharded (a tied vocab-parallel embedding), and the step pairs local gradient rows with local
    parameter rows (DTensor's own ops redistribute so for PyTorch's optimizers)."""
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
        return grad.redistribute(p.device_mesh, p.placements)
    return grad


def sharding_groups(p: torch.Tensor, dims: set[int] | None = None) -> list:
    """Process groups of ``p``'s mesh dimensions that shard one of tensor dims ``dims`` (None: any dim).
    Any placement with a ``dim`` counts (FSDP2 over tensor parallelism shards with ``_StridedShard``)."""
    if not isinstance(p, DTensor):
        return []
    return [p.device_mesh.get_group(m) for m, pl in enumerate(p.placements)
            if getattr(pl, "dim", None) is not None and (dims is None or pl.dim % p.dim() in dims)]


def _summed(t: torch.Tensor, groups: list) -> torch.Tensor:
    """``t`` all-reduced (SUM) over each of ``groups`` in turn: the sum over every rank of their product."""
    for group in groups:
        dist.all_reduce(t, group=group)
    return t


def _squares(t: torch.Tensor, p: torch.Tensor) -> float:
    """Sum of squares of ``t`` (the local part of a tensor sharded as ``p``) over the whole tensor."""
    return float(_summed(t.float().pow(2).sum().reshape(1), sharding_groups(p)))


def _stat_like(p: torch.Tensor, local: torch.Tensor, summed_dim: int) -> torch.Tensor:
    """``local`` (a row or column statistic of ``p``'s local shard) as a DTensor of its global shape, placed like
    ``p`` but replicated over the mesh dims that shard ``summed_dim`` (the statistic was all-reduced there)."""
    if not isinstance(p, DTensor):
        return local
    placements = [Replicate() if getattr(pl, "dim", None) is not None and pl.dim % p.dim() == summed_dim else pl
                  for pl in p.placements]
    shape = list(p.shape)
    shape[summed_dim] = 1
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, p.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)


class ShardedAdafactor(torch.optim.Adafactor):
    """``torch.optim.Adafactor`` whose step reads full-matrix statistics through all-reduces (module doc).
    Same hyperparameters and state keys (``step``, ``row_var``, ``col_var``, ``variance``); the per-tensor loop
    (``foreach`` is refused: the spec's ``optim.implementation`` check)."""

    def __init__(self, params, **kwargs):
        if kwargs.get("foreach"):
            raise ValueError("ShardedAdafactor steps one tensor at a time: foreach=True is not supported; "
                             "use optim.implementation auto or for_loop")
        super().__init__(params, **{**kwargs, "foreach": False})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _state(self, p: torch.Tensor) -> dict:
        """``p``'s state, made on first use as PyTorch makes it (a matrix's factored pair, a vector's variance)."""
        state = self.state[p]
        if not state:
            param = _local(p)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if p.dim() > 1:
                row = param.new_zeros((*param.shape[:-1], 1))
                col = param.new_zeros((*param.shape[:-2], 1, param.shape[-1]))
                state["row_var"] = _stat_like(p, row, p.dim() - 1)
                state["col_var"] = _stat_like(p, col, p.dim() - 2)
            else:
                state["variance"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _update(self, p: torch.Tensor, group: dict) -> None:
        """One step of ``p`` (``torch.optim._adafactor._single_tensor_adafactor``, with global statistics)."""
        state = self._state(p)
        param, grad = _local(p), _local(_placed_like(p.grad, p))
        if group["maximize"]:
            grad = -grad
        lr = float(group["lr"])
        eps1, eps2 = group["eps"]
        eps1 = torch.finfo(param.dtype).eps if eps1 is None else eps1
        state["step"] += 1
        step = state["step"].item()
        one_minus_beta2 = step ** group["beta2_decay"]
        rho = min(lr, 1 / step ** 0.5)
        alpha = max(eps2, math.sqrt(_squares(param, p)) / p.numel() ** 0.5) * rho
        if group["weight_decay"]:
            param.mul_(1 - lr * group["weight_decay"])
        if p.dim() > 1:
            estimate = self._factored(p, grad, state, one_minus_beta2, eps1)
        else:
            variance = _local(state["variance"])
            variance.lerp_(grad * grad, one_minus_beta2)
            estimate = variance.clone()
        update = estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad)
        denom = max(1.0, math.sqrt(_squares(update, p)) / (p.numel() ** 0.5 * group["d"]))
        param.add_(update, alpha=-alpha / denom)

    @staticmethod
    def _factored(p: torch.Tensor, grad: torch.Tensor, state: dict, weight: float, eps1: float) -> torch.Tensor:
        """The second-moment estimate of ``p``'s local shard: row and column means of g² over the whole matrix,
        folded into the running ``row_var``/``col_var``, and their outer product over the mean of all rows."""
        last, second = p.dim() - 1, p.dim() - 2
        rows, cols = p.shape[-2], p.shape[-1]
        row_var, col_var = _local(state["row_var"]), _local(state["col_var"])
        row_mean = _summed(grad.float().pow(2).sum(dim=-1, keepdim=True), sharding_groups(p, {last}))
        row_var.lerp_(row_mean.div_(cols).to(row_var.dtype), weight)
        col_mean = _summed(grad.float().pow(2).sum(dim=-2, keepdim=True), sharding_groups(p, {second}))
        col_var.lerp_(col_mean.div_(rows).to(col_var.dtype), weight)
        row_total = _summed(row_var.sum(dim=-2, keepdim=True), sharding_groups(p, {second}))
        return (row_var @ col_var).div_((row_total / rows).clamp_(min=eps1))
