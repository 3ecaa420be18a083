"""What the step's parts share: the rank's build-time parts (``StepKit``), one step's context (``StepContext``),
and the ``StepHook`` protocol with its composite (``Hooks``).

Why a kit: the engines, objectives and hooks are chosen and built once from what the rank built (model parts,
``TrainState``, groups, the spec); they read it from one frozen record instead of a back-reference to the
``Trainer``, so none of them can reach into another's state or the trainer's.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workers.diagnostics.faults import NO_FAULT, StepFault

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import torch
    from torch import nn

    from workers.parallel.parallelize import ModelParts
    from workers.parallel.ps_sync import PSSync
    from workers.spec import WorkerSpec
    from workers.state.train_state import TrainState


@dataclass(frozen=True)
class StepKit:
    """The rank as built, read by the step's parts when they are built (never changed by them).

    ``params``: every parameter of the parts; ``zero1``: ZeRO-1's sliced optimizers (empty otherwise);
    ``expert_norm``: what the clip sums over expert parallelism (``Trainer._train_state``); ``autocast``: the
    precision's autocast context (a no-op without one); ``activations``: the activation offload policy;
    ``ps``: the parameter-server client side under ``dp_sync: ps``, else None."""

    spec: WorkerSpec
    rank: int
    device: torch.device
    mesh: Any
    parts: ModelParts
    state: TrainState
    params: list
    zero1: list
    expert_norm: tuple
    dp_group: Any
    pp_group: Any
    autocast: Callable[[], contextlib.AbstractContextManager]
    activations: Any
    ps: PSSync | None = None

    @property
    def microbatches(self) -> int:
        return self.spec.train.microbatches

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.parts.stage_ids

    @property
    def holds_last_stage(self) -> bool:
        return self.parts.n_stages - 1 in self.parts.stage_ids

    @property
    def head_part(self) -> nn.Module | None:
        """The model part holding the last stage (its head), unwrapped; None where this rank holds none."""
        from workers.model.names import unwrap

        if not self.holds_last_stage:
            return None
        return unwrap(self.parts.modules[self.parts.stage_ids.index(self.parts.n_stages - 1)])

    @property
    def stepped_params(self) -> list:
        """What the optimizers step, whose gradients the clip reads: the parameters, or under ZeRO-1 this rank's
        slices of them (holding the dp-reduced gradients)."""
        return [p for opt in self.state.optimizers for group in opt.param_groups for p in group["params"]]


@dataclass
class StepContext:
    """One step as its engine, objective and hooks see it: the state it advances, its injected fault, the hooks
    to call, and what the step leaves for the hooks (its events, the learning rate it trained at, the figures
    of the result's ``extras``)."""

    state: TrainState
    hooks: Hooks
    fault: StepFault = NO_FAULT
    events: list[dict] = field(default_factory=list)  # pipeline F/B/W, or forward+backward per microbatch (FB)
    comm_events: list[dict] = field(default_factory=list)  # gradient bucket reductions (allreduce)
    extras: dict[str, Any] = field(default_factory=dict)  # the result's figures, by figure key
    marks: dict[str, float] = field(default_factory=dict)  # perf_counter() at each phase's end, by phase
    lr: float = float("nan")  # the learning rate the step trained at (read before the schedule moves)

    @property
    def step(self) -> int:
        """The state's step count: the step being trained before the update, the one reported after it."""
        return self.state.step

    def mark(self, phase: str) -> float:
        self.marks[phase] = time.perf_counter()
        return self.marks[phase]


class StepHook:
    """A per-step feature (MoE statistics, evaluation, comm bytes ...): what it does around a synchronous step,
    and the figure it adds to the result. Every method is optional.

    - ``before_step``: before the batch is read (``ctx.step`` is the step about to train);
    - ``scope(ctx, region)``: a context around ``"counted"`` (from the batch read to the step's end: the
      collectives a step issues) or ``"compute"`` (forward and backward);
    - ``after_update``: inside ``counted``, once the optimizers stepped, while parameters, gradients and
      optimizer state all live;
    - ``after_step``: after the step's clock stopped (``ctx.step`` is the step reported); put the figure in
      ``ctx.extras[key]``, the key having a reducer in ``workers.contract.figures``.

    An asynchronous PS round calls only ``after_step``: its local steps run on their own thread."""

    def before_step(self, ctx: StepContext) -> None:
        pass

    def scope(self, ctx: StepContext, region: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def after_update(self, ctx: StepContext) -> None:
        pass

    def after_step(self, ctx: StepContext) -> None:
        pass


class Hooks(StepHook):
    """The rank's hooks as one, each method called on every hook in order."""

    def __init__(self, hooks: list[StepHook]):
        self.hooks = list(hooks)

    def before_step(self, ctx: StepContext) -> None:
        for hook in self.hooks:
            hook.before_step(ctx)

    @contextlib.contextmanager
    def scope(self, ctx: StepContext, region: str) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.scope(ctx, region))
            yield

    def after_update(self, ctx: StepContext) -> None:
        for hook in self.hooks:
            hook.after_update(ctx)

    def after_step(self, ctx: StepContext) -> None:
        for hook in self.hooks:
            hook.after_step(ctx)
