"""What a step minimises: one ``Objective`` per loss, registered by ``train.objective``.

- ``MeanLM``: the microbatch's mean token loss (a plain corpus under ``objective: lm``);
- ``MaskedLM``: under a loss mask (prompt/completion data), the sum of cross entropy over every counted target of
  the global batch over their global count, whatever the layout (``prepare_step`` all-reduces the count);
- ``DPO``: the mean DPO loss of the microbatch's pairs against the reference policy, the same model with its
  LoRA adapters disabled (``prepare_microbatch`` scores it), its rewards tallied for the step's ``dpo`` figure.

An objective is also a ``StepHook`` (its per-step figures). The engines ask it for ``loss`` (before the fp16 scale
and a ``nan_loss`` fault, which ``workers.step.engine.StepLoss`` adds) and for a microbatch's ``share`` of the
step's loss. A new objective is one class and one ``register_objective`` call (its own module will do).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from workers.data.loader import IGNORE_INDEX
from workers.model.dpo import RewardTally, pair_losses, sequence_logps
from workers.model.gpt import model_loss
from workers.model.lora import adapters_disabled
from workers.model.names import unwrap
from workers.parallel.process_group import data_parallel_mesh
from workers.step.context import StepContext, StepHook, StepKit

log = logging.getLogger(__name__)


class Objective(StepHook):
    """A loss over one microbatch, and what it needs per step and per microbatch (see the module docstring)."""

    def __init__(self, kit: StepKit):
        self.head = kit.head_part  # the unwrapped part holding the head (None off the last stage)

    def prepare_step(self, targets: torch.Tensor, ctx: StepContext) -> None:
        """Once per step, after the batch is read and before the step's collectives are counted."""

    def prepare_microbatch(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Before each microbatch's forward under gradient accumulation."""

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The microbatch's loss. ``logits``: the last stage's output, its final hidden state under
        ``train.loss_chunks`` > 1 (``model_loss`` applies the head)."""
        raise NotImplementedError

    def share(self, loss: torch.Tensor, parts: int) -> torch.Tensor:
        """The microbatch's share of the step's loss (pipeline schedules and accumulation sum gradients,
        unscaled): its mean over the ``parts`` microbatches."""
        return loss / parts


class MeanLM(Objective):
    """The mean token loss of each microbatch; the step's loss is the mean of the microbatches' means."""

    def loss(self, logits, targets):
        return model_loss(self.head, logits, targets)


class MaskedLM(Objective):
    """Under a loss mask, each microbatch's counted targets' summed loss times ``counted_scale``: the step's loss is
    their sum over the global batch over their global count."""

    def __init__(self, kit: StepKit):
        super().__init__(kit)
        dp_mesh = data_parallel_mesh(kit.mesh, kit.spec.parallel.grid)
        self.group = dp_mesh.get_group() if dp_mesh.size() > 1 else None
        self.ranks, self.rank, self.path = dp_mesh.size(), kit.rank, kit.state.cursor.dataset.path
        self.counted_scale = 1.0

    def prepare_step(self, targets, ctx):
        """Set ``counted_scale``: microbatches and ranks hold different counts, so a mean per microbatch averaged
        would weigh their targets unequally. One all-reduce of this rank's count over the ranks gradients are
        averaged over (dp, x cp: those hold other targets; tp and pp peers the same), whose averaging the scale
        undoes (x their number)."""
        count = (targets != IGNORE_INDEX).sum()
        if self.group is not None:
            dist.all_reduce(count, group=self.group)
        total = int(count)
        if total == 0 and self.rank == 0:
            log.warning("step %d: no target of the global batch is a completion token (the loss mask of %s hides "
                        "them all); its loss is 0 and its gradients zero", ctx.step, self.path)
        self.counted_scale = self.ranks / max(total, 1)

    def loss(self, logits, targets):
        return model_loss(self.head, logits, targets, reduction="sum") * self.counted_scale

    def share(self, loss, parts):
        return loss  # already the counted targets' share of the step's loss


class DPO(Objective):
    """The mean DPO loss of the microbatch's pairs (``workers.model.dpo``). A mean per microbatch over their count
    and over dp is the global batch's mean, since every microbatch holds the same number of pairs
    (``orchestrator/spec/checks/dpo.py``). Its figure: the step's rewards, reduced over dp."""

    def __init__(self, kit: StepKit):
        super().__init__(kit)
        self.device, self.group, self.beta = kit.device, kit.dp_group, kit.spec.train.dpo_beta
        self.rewards = RewardTally(self.device)
        self.reference: torch.Tensor | None = None  # the reference's log-probabilities of the microbatch running
        self.figures: dict[str, float] | None = None

    def prepare_step(self, targets, ctx):
        self.rewards = RewardTally(self.device)

    def prepare_microbatch(self, model, inputs, targets):
        """The reference policy's sequence log-probabilities of this microbatch: one forward without gradients
        with the LoRA adapters disabled (the same weights, no second copy), past any DDP wrapper (nothing to
        reduce); FSDP2 gathers and frees the shards around it as around any forward."""
        with torch.no_grad(), adapters_disabled([model]):
            self.reference = sequence_logps(unwrap(model)(inputs), targets)

    def loss(self, logits, targets):
        losses, rewards = pair_losses(sequence_logps(logits, targets), self.reference, self.beta)
        self.rewards.add(rewards)
        return losses.mean()

    def after_update(self, ctx):
        self.figures = self.rewards.figures(self.group)  # inside the step's counted collectives

    def after_step(self, ctx):
        ctx.extras["dpo"] = self.figures


def _language_model(kit: StepKit) -> Objective:
    """``objective: lm``: masked where the data carries a loss mask, else the plain mean."""
    return MaskedLM(kit) if kit.state.cursor.dataset.loss_mask else MeanLM(kit)


OBJECTIVES: dict[str, Callable[[StepKit], Objective]] = {"lm": _language_model, "dpo": DPO}


def register_objective(name: str, build: Callable[[StepKit], Objective], replace: bool = False) -> None:
    """Make ``train.objective: name`` build its objective with ``build(kit)``."""
    if name in OBJECTIVES and not replace:
        raise ValueError(f"objective {name!r} is registered already; pick another name, or pass replace=True")
    OBJECTIVES[name] = build


def check_objective(name: str) -> None:
    """Refuse a ``train.objective`` no objective is registered for (before the rank builds anything)."""
    if name not in OBJECTIVES:
        raise ValueError(f"train.objective {name!r} has no registered objective (known: {sorted(OBJECTIVES)}); "
                         "set train.objective to one of them, or register_objective() it in workers/step/objectives.py")


def build_objective(kit: StepKit) -> Objective:
    """The job's objective (``train.objective``)."""
    check_objective(kit.spec.train.objective)
    return OBJECTIVES[kit.spec.train.objective](kit)
