"""asp/ssp parameter-server rounds: each worker trains on its own thread, a controller step is a round.

``run(batch, objective)`` is one local step (pull the shards' weights, forward and backward through the inner
engine, clip this replica's gradient, push it); ``step`` waits for the round (``PSSync.run_round``) and reports
what the worker did meanwhile. Only ``after_step`` hooks run around a round: its local steps are the free thread's.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.optim.build import clip_grads
from workers.step.context import StepContext, StepKit
from workers.step.engine import StepEngine, outcome
from workers.step.objectives import Objective


class PSRound:
    """The round engine around a synchronous one (``inner``: accumulation or a pipeline schedule), whose
    ``forward_backward`` each local step runs."""

    def __init__(self, kit: StepKit, inner: StepEngine):
        self.ps, self.inner, self.state, self.device = kit.ps, inner, kit.state, kit.device
        self.params, self.pp_group, self.max_norm = kit.params, kit.pp_group, kit.spec.optim.grad_clip

    def step(self, ctx: StepContext, objective: Objective) -> dict[str, Any]:
        """One controller step: the round, and its local steps and clock as the result's figures."""
        figures = self.ps.run_round(ctx.fault, lambda: self._local_step(objective))
        ctx.extras.update(local_steps=figures.pop("local_steps"), clock=figures.pop("clock"))
        return outcome(**figures)

    def _local_step(self, objective: Objective) -> dict:
        """Read this worker's next batch and run it; its record for the round."""
        inputs, targets = self.state.cursor.next_batch()
        clock = self.ps.clock
        loss, norm, applied = self.run((inputs, targets), objective)
        return {"clock": clock, "loss": loss, "grad_norm": norm, "tokens": int(inputs.numel()), "applied": applied}

    def run(self, batch: tuple[torch.Tensor, torch.Tensor], objective: Objective,
            ctx: StepContext | None = None) -> tuple[float | None, float, bool]:
        """Pull, compute, clip this replica's gradient (its norm summed over the replica's stages) and push it;
        after an fp16 overflow in any of the replica's stages, push nothing but the clock (the scaler has backed
        off)."""
        self.ps.pull()
        inputs, targets = batch
        scaler = self.state.scaler
        scale = scaler.scale if scaler else 1.0
        self.inner.loss.objective = objective
        self.inner.clear_events()  # nothing reads a local step's events
        loss = self.inner.forward_backward(inputs.to(self.device), targets.to(self.device))
        finite = scaler is None or scaler.unscale_and_check(self.params, group=self.pp_group)
        norm = clip_grads(self.params, self.max_norm, self.pp_group) if finite else float("nan")
        self.ps.push_local(finite)
        for p in self.params:
            p.grad = None
        return None if loss is None else float(loss) / scale, norm, finite
