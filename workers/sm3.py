"""SM3 (Anil, Gupta, Koren, Singer 2019, "Memory-Efficient Adaptive Optimization", SM3-II).

Our own implementation: PyTorch ships none. Adagrad keeps a second-moment sum
per parameter entry; SM3 keeps one accumulator vector per tensor dimension
(a d1 x d2 matrix costs d1 + d2 floats, not d1 * d2). Each step, per entry,

    nu = min_i acc_i[index_i] + g^2          (a tight upper bound on Adagrad's sum)
    acc_i = max of nu over all dims but i    (so the cover stays an upper bound)
    update = g / (sqrt(nu) + eps),  with optional momentum on the update,

and the parameter moves by -lr * update. Tensors of rank <= 1 keep a full
accumulator (SM3 = Adagrad there). Replicated DTensor parameters (``replicate``,
zero 0) step on their local copies; sharded ones are refused by the job spec,
since the cover maxima would need reductions across shards.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        if any(pl.is_shard() for pl in t.placements):
            raise ValueError("SM3 steps whole (or replicated) tensors, not shards")
        return t.to_local()
    return t


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
            others = [d for d in range(param.dim()) if d != i]
            acc.copy_(nu.amax(dim=others, keepdim=True) if param.dim() > 1 else nu)
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
