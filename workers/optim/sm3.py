"""SM3 (Anil, Gupta, Koren, Singer 2019, "Memory-Efficient Adaptive Optimization", SM3-II).

Our own implementation: PyTorch ships none. Adagrad keeps a second-moment sum
per parameter entry; SM3 keeps one accumulator vector per tensor dimension
(a d1 x d2 matrix costs d1 + d2 floats, not d1 * d2). Each step, per entry,

    nu = min_i acc_i[index_i] + g^2          (a tight upper bound on Adagrad's sum)
    acc_i = max of nu over all dims but i    (so the cover stays an upper bound)
    update = g / (sqrt(nu) + eps),  with optional momentum on the update,

and the parameter moves by -lr * update. Tensors of rank <= 1 keep a full
accumulator (SM3 = Adagrad there).

Sharded DTensor parameters (FSDP2's ZeRO-2/3, tensor parallelism, both) step
on their local shards exactly: a cover entry is a maximum, so the accumulator
of dimension i is the local maximum all-reduced (MAX) over each mesh dimension
that shards a tensor dimension other than i; the accumulator of a sharded
dimension stays a local shard. That is one small all-reduce per accumulator and
sharding mesh dimension, of d_i floats, per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _cover_groups(p: torch.Tensor, i: int) -> list:
    """Process groups over which accumulator ``i`` of ``p`` is a maximum: mesh dims sharding another dim.
    (Any placement with a ``dim``: FSDP2 over TP shards with ``_StridedShard``, not a ``Shard``.)"""
    if not isinstance(p, DTensor):
        return []
    return [p.device_mesh.get_group(m) for m, pl in enumerate(p.placements)
            if getattr(pl, "dim", None) is not None and pl.dim % p.dim() != i]


class SM3(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.1, momentum: float = 0.0, weight_decay: float = 0.0, eps: float = 1e-30):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        param, grad = _local(p), _local(p.grad)
        if group["weight_decay"]:
            grad = grad.add(param, alpha=group["weight_decay"])
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            for i, shape in enumerate(_cover_shapes(param)):
                state[f"acc_{i}"] = param.new_zeros(shape)
            if group["momentum"]:
                state["momentum_buffer"] = torch.zeros_like(param)
        state["step"] += 1
        accs = [state[f"acc_{i}"] for i in range(len(_cover_shapes(param)))]
        nu = accs[0]
        for acc in accs[1:]:
            nu = torch.minimum(nu, acc)
        nu = nu + grad * grad
        for i, acc in enumerate(accs):
            if param.dim() < 2:
                acc.copy_(nu)
                continue
            others = [d for d in range(param.dim()) if d != i]
            if nu.numel():
                acc.copy_(nu.amax(dim=others, keepdim=True))
            else:  # an empty FSDP2 shard (more ranks than rows) adds nothing to the maximum
                acc.zero_()
            for pg in _cover_groups(p, i):
                dist.all_reduce(acc, op=dist.ReduceOp.MAX, group=pg)
        update = grad / (nu.sqrt() + group["eps"])
        if group["momentum"]:
            buf = state["momentum_buffer"]
            buf.mul_(group["momentum"]).add_(update, alpha=1 - group["momentum"])
            update = buf
        param.add_(update, alpha=-group["lr"])


def _cover_shapes(p: torch.Tensor) -> list[tuple[int, ...]]:
    """One accumulator per dimension, shaped to broadcast along every other; a full one below rank 2."""
    if p.dim() < 2:
        return [tuple(p.shape)]
    return [tuple(n if d == i else 1 for d, n in enumerate(p.shape)) for i in range(p.dim())]
