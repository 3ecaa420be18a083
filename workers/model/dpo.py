"""Direct Preference Optimization (Rafailov et al., 2023) on pairs of sequences, as TRL's ``DPOTrainer`` computes it.

A batch holds each pair as two consecutive sequences, chosen then rejected (``prepare-data --format preference``),
whose loss mask flags the completion's tokens. A sequence's log-probability is the sum of its counted targets'
token log-probabilities; the reference policy is the same model with its LoRA adapters disabled
(``workers.model.lora.adapters_disabled``), so no second copy of the weights is held. Per pair::

    loss = -logsigmoid(beta * ((pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)))

and the rewards TRL logs are ``beta * (pi - ref)`` of each side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.model.gpt import lm_loss

FIGURES = ("reward_accuracy", "chosen_reward", "rejected_reward", "reward_margin")  # the step record's `dpo` keys


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[batch] summed log-probability of each sequence's counted targets (``-100`` targets add nothing), float32."""
    tokens = lm_loss(logits, targets, reduction="none").view(targets.shape)
    return -tokens.sum(-1)


def pair_losses(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-pair losses, [pairs, 2] rewards chosen/rejected) of sequence log-probabilities laid out chosen,
    rejected, chosen, ... (``policy`` carries the gradient, ``reference`` none)."""
    rewards = beta * (policy - reference.detach()).view(-1, 2)
    return -F.logsigmoid(rewards[:, 0] - rewards[:, 1]), rewards.detach()


class RewardTally:
    """A step's reward figures summed over its pairs (correct, chosen, rejected, pairs), reduced over the ranks
    that hold other pairs, so every rank reports the global batch's means: a layout's own split drops out."""

    def __init__(self, device: torch.device) -> None:
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)

    def add(self, rewards: torch.Tensor) -> None:
        chosen, rejected = rewards[:, 0].double(), rewards[:, 1].double()
        self.sums += torch.stack([(chosen > rejected).double().sum(), chosen.sum(), rejected.sum(),
                                  torch.tensor(float(len(chosen)), dtype=torch.float64, device=chosen.device)])

    def figures(self, group=None) -> dict[str, float]:
        """The means over every pair of the step (``group``: the data-parallel ranks, summed over), by `FIGURES`."""
        if group is not None:
            torch.distributed.all_reduce(self.sums, group=group)
        correct, chosen, rejected, _ = (float(v) for v in self.sums / max(float(self.sums[3]), 1.0))
        return dict(zip(FIGURES, (correct, chosen, rejected, chosen - rejected)))
