"""Dynamic loss scaling for fp16 that agrees across every rank.

``torch.amp.GradScaler`` decides overflow from the gradients it can see; under
pipeline or tensor parallelism each rank sees only its share, so one stage
could skip a step that another applies. This scaler all-reduces the overflow
flag over the whole job before deciding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

EVERY_RANK = object()  # ``unscale_and_check``'s default group: the job's default process group


class DynamicLossScaler:
    def __init__(self, initial_scale: float, growth_interval: int = 200, factor: float = 2.0):
        self.scale = initial_scale
        self.growth_interval = growth_interval
        self.factor = factor
        self.good_steps = 0

    def unscale_and_check(self, params: list[torch.nn.Parameter], group=EVERY_RANK) -> bool:
        """Divide grads by the scale in place; return True when the grads of every rank in ``group`` are finite
        (every rank of the job by default; None: this rank alone, as a free-running parameter-server worker
        without a pipeline decides for itself)."""
        finite = torch.ones(1, device=params[0].device)
        for p in params:
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            g.div_(self.scale)
            if not torch.isfinite(g).all():
                finite.zero_()
        if group is not None and dist.is_initialized():
            dist.all_reduce(finite, op=dist.ReduceOp.MIN, **({} if group is EVERY_RANK else {"group": group}))
        ok = bool(finite.item())
        if ok:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= self.factor
        else:
            self.scale /= self.factor
            self.good_steps = 0
        return ok

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
