"""Step engines: one per way a rank turns a batch into an update, chosen once when the rank is built.

Every engine has ``run(batch, objective, ctx) -> (loss, grad_norm, applied)`` (forward and backward over the
microbatches, gradient reduction, the update) and ``step(ctx, objective)`` (one controller step: read the batch,
run it, time its phases; returns the result's core fields, ``outcome``). ``Accumulate`` is gradient accumulation
over one model part; the pipelines (``workers.step.pipeline``) and asp/ssp parameter-server rounds
(``workers.step.ps_round``) are the others, as Megatron's ``get_forward_backward_func`` returns one of its
schedules with one signature.

How the gradients are reduced and applied is the engine's ``GradSync``: the all-reduce path (the wrappers
reduced them in backward; clip on the global norm, the optimizers step) or the parameter server's bsp push/pull.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from workers.diagnostics.faults import NO_FAULT
from workers.diagnostics.timeline import busy_seconds
from workers.model.documents import attending, split_documents
from workers.optim.build import clip_grads
from workers.protocol import StepTimes
from workers.step.context import StepContext, StepKit
from workers.step.objectives import Objective


def outcome(loss: float | None, grad_norm: float, lr: float, tokens: int, applied: bool,
            time_s: StepTimes) -> dict[str, Any]:
    """One controller step's core fields of its ``StepResult`` (the hooks add theirs to ``StepContext.extras``;
    the trainer adds the rank's identity and memory)."""
    return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": tokens, "applied": applied, "time_s": time_s}


class StepLoss:
    """The loss a backward runs on: the objective's, poisoned by this step's ``nan_loss`` fault, times fp16's
    loss scale; ``share`` divides it into the step's (``Objective.share``). Bound to the objective and the
    fault at each step's start (a pipeline schedule holds it from its build)."""

    def __init__(self, kit: StepKit):
        self.state, self.microbatches = kit.state, kit.microbatches
        self.objective: Objective | None = None
        self.fault = NO_FAULT

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.objective.loss(logits, targets)
        if self.fault.poisons_loss:
            loss = loss * float("nan")
        return loss * self.state.scaler.scale if self.state.scaler else loss

    def share(self, logits: torch.Tensor, targets: torch.Tensor, parts: int | None = None) -> torch.Tensor:
        return self.objective.share(self(logits, targets), parts or self.microbatches)


class GradSync:
    """The all-reduce path: the data-parallel wrappers and buckets reduced the gradients in backward (``finish``
    waits for the buckets), ZeRO-1 reduce-scatters its slices, fp16 unscales and votes, the clip reads the
    global norm, and the optimizers step."""

    steps_optimizer = True  # the optimizers step here (not on the shards, nor between microbatches)
    stepped_within = False  # PipeDream: the updates ran between the microbatches (and zeroed their gradients)

    def __init__(self, kit: StepKit):
        self.state, self.reducers, self.zero1 = kit.state, kit.parts.reducers, kit.zero1
        self.params, self.stepped = kit.params, kit.stepped_params
        self.grad_clip, self.pp_group, self.expert_norm = kit.spec.optim.grad_clip, kit.pp_group, kit.expert_norm

    def begin(self, step: int) -> None:
        """Tell the gradient buckets the step (PowerSGD's warm-up counts it), and keep them silent while an
        optimizer averages over data parallelism itself (``onebit_adam`` after its warm-up: its compressed
        momentum is what crosses the group)."""
        for reducer, opt in zip(self.reducers, self.state.optimizers):
            reducer.begin(step, paused=bool(getattr(opt, "communicates", False)))

    def reduce(self, loss: torch.Tensor | None) -> tuple[torch.Tensor | None, float, bool]:
        """Finish the buckets, unscale (fp16), then clip on the global norm (``norm``). Returns the unscaled loss,
        the norm and whether to step."""
        for reducer in self.reducers:
            reducer.finish()
        applied = True
        if self.state.scaler is not None:
            scale = self.state.scaler.scale  # the forward's: the check moves it (halved on overflow, grown after
            applied = self.state.scaler.unscale_and_check(self.params)  # a run of good steps)
            if loss is not None:
                loss = loss / scale  # a skipped step's loss is recorded too, unscaled like any other
        for zero1 in self.zero1:
            zero1.reduce_scatter()
        return loss, self.norm(applied), applied

    def norm(self, applied: bool) -> float:
        if not applied:
            return float("nan")
        return clip_grads(self.stepped, self.grad_clip, self.pp_group, self.expert_norm)

    def update(self, applied: bool, ctx: StepContext) -> None:
        """Step, let the hooks read the step's memory (``after_update``), zero and schedule; the step count
        moves on."""
        for opt in self.state.optimizers:
            if applied and self.steps_optimizer:
                opt.step()
        for zero1 in self.zero1:
            if applied:
                zero1.all_gather()
        ctx.hooks.after_update(ctx)
        for opt, sched in zip(self.state.optimizers, self.state.schedulers):
            if not self.stepped_within:  # PipeDream zeroes after each update: a 2BW window may span steps
                opt.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                # torch warns of a skipped LR value when no update ran before the schedule's first step. Expected
                # twice: 2BW's first update on an early stage may come a step later (each update runs at its
                # step's LR, step_lrs), and an fp16 step that overflowed is skipped while its LR value passes, as
                # in PyTorch's own AMP recipe (GradScaler.step, then the scheduler's), so the schedule follows
                # the step count, which a resume and the records count by too.
                if self.stepped_within or not applied:
                    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
                sched.step()
        for zero1 in self.zero1:
            zero1.zero_grad()
        self.state.step += 1


class PSGradSync(GradSync):
    """``dp_sync: ps`` with ``consistency: bsp``: the shards clip on the averaged gradient's norm, step and send
    the new weights back (``PSSync.sync``); an fp16 step every rank found overflowed passes its clock."""

    steps_optimizer = False

    def __init__(self, kit: StepKit):
        super().__init__(kit)
        self.ps = kit.ps

    def norm(self, applied: bool) -> float:
        return self.ps.sync() if applied else self.ps.skip()


class StepEngine:
    """A synchronous way of stepping: ``forward_backward`` is each engine's; reading, reducing, updating and
    timing are shared (see ``step``)."""

    timed_by_events = True  # compute time is the union of the step's events (pipelines), else its whole window

    def __init__(self, kit: StepKit, sync: GradSync):
        self.kit, self.state, self.sync, self.device = kit, kit.state, sync, kit.device
        self.microbatches, self.autocast, self.activations = kit.microbatches, kit.autocast, kit.activations
        self.loss = StepLoss(kit)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """The summed loss shares of this rank's microbatches (``None`` where no last stage lives)."""
        raise NotImplementedError

    def events(self) -> list[dict]:
        """This step's compute events: pipeline F/B/W, or forward+backward per microbatch (``FB``)."""
        raise NotImplementedError

    def clear_events(self) -> None:
        raise NotImplementedError

    def documents(self) -> list:
        """Under ``model.attention_mask: document`` each microbatch's document ids (of the batch the cursor just
        gave, whole windows: every rank has them, pipeline stages without tokens and cp shares too), for the
        attention cores while it runs forward and backward (recompute replays the forward there)."""
        return split_documents(self.state.cursor.documents, self.microbatches, self.device)

    def step(self, ctx: StepContext, objective: Objective) -> dict[str, Any]:
        """One optimizer step, timed per phase: ``data`` reading the batch (and the objective's preparation),
        ``compute`` forward/backward (for pipelines, the union of this rank's F/B/W chunks; gradient reduction
        overlapped with backward counts here), ``bubble`` the rest of the pipeline window (idle or waiting on a
        neighbour), ``communication`` the explicit collectives after backward (global grad norm, loss-scale
        agreement), ``optimizer`` the update. A ``slow_rank`` fault stretches compute and step."""
        ctx.fault.before()
        self.loss.fault = ctx.fault
        self.clear_events()
        self.sync.begin(ctx.step)
        t0 = ctx.mark("start")
        ctx.hooks.before_step(ctx)
        inputs, targets = self.state.cursor.next_batch()
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        objective.prepare_step(targets, ctx)
        t1 = ctx.mark("data")
        with ctx.hooks.scope(ctx, "counted"):  # metrics.comm_bytes: count this step's collectives
            loss, grad_norm, applied = self.run((inputs, targets), objective, ctx)
        t4 = ctx.mark("end")
        slowed = ctx.fault.slow_down(t4 - t0)
        ctx.events = self.events()
        ctx.comm_events = [e for reducer in self.kit.parts.reducers for e in reducer.take_events()]
        t2, t3 = ctx.marks["compute"], ctx.marks["reduced"]
        compute = busy_seconds(ctx.events) if self.timed_by_events else t2 - t1
        times = StepTimes(data=t1 - t0, compute=compute + slowed, bubble=max(0.0, (t2 - t1) - compute),
                          communication=t3 - t2, optimizer=t4 - t3, step=t4 - t0 + slowed)
        return outcome(None if loss is None else float(loss), grad_norm, ctx.lr, int(inputs.numel()), applied, times)

    def run(self, batch: tuple[torch.Tensor, torch.Tensor], objective: Objective,
            ctx: StepContext) -> tuple[torch.Tensor | None, float, bool]:
        """Forward and backward under the hooks' ``compute`` scope, reduce, update."""
        self.loss.objective = objective
        with ctx.hooks.scope(ctx, "compute"):
            loss = self.forward_backward(*batch)
        ctx.mark("compute")
        loss, grad_norm, applied = self.sync.reduce(loss)
        ctx.mark("reduced")
        ctx.lr = self.state.schedulers[0].get_last_lr()[0]  # the rate this step trains at, before the schedule
        self.sync.update(applied, ctx)  # moves
        return loss, grad_norm, applied


class Accumulate(StepEngine):
    """Gradient accumulation over this rank's one model part: each microbatch's forward and backward in turn,
    the data-parallel reduction only on the last."""

    timed_by_events = False

    def __init__(self, kit: StepKit, sync: GradSync):
        super().__init__(kit, sync)
        self.model = kit.parts.modules[0]
        self._events: list[dict] = []

    def events(self) -> list[dict]:
        return list(self._events)

    def clear_events(self) -> None:
        self._events.clear()

    def forward_backward(self, inputs, targets):
        documents = self.documents()
        objective, model = self.loss.objective, self.model
        total = torch.zeros((), device=self.device)
        chunks = list(zip(inputs.chunk(self.microbatches), targets.chunk(self.microbatches)))
        for i, (x, y) in enumerate(chunks):
            start = time.time()
            with _sync_grads(model, i == len(chunks) - 1), self.autocast(), self.activations.hooks(), \
                    attending([model], documents[i]):
                objective.prepare_microbatch(model, x, y)
                loss = self.loss.share(model(x), y, len(chunks))
                loss.backward()
            self._events.append({"stage": 0, "microbatch": i, "kind": "FB", "start": start, "end": time.time()})
            total += loss.detach().float()
        return total


def _sync_grads(model, last: bool):
    """Reduce gradients only on the last accumulation microbatch."""
    if isinstance(model, DDP) and not last:
        return model.no_sync()
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()
