"""Multi-token prediction (``model.mtp_layers``, DeepSeek-V3 technical report section 2.2).

D modules run one after another on top of the main model. Module k (1-based) takes, at each position i, the
previous depth's hidden state h^{k-1}_i (depth 0: the main model's last hidden state before its final norm) and
the embedding of token t_{i+k}; it RMS-normalises both (``hnorm``, ``enorm``), projects their concatenation from
2d to d (``eh_proj``; embedding first, as DeepSeek's checkpoints lay the matrix out), runs one transformer block
of the family's kind (MLA and the MoE or dense feed-forward ``ModelConfig.is_moe_layer`` gives block index
``n_layers + k - 1``), and predicts t_{i+k+1} through its own final norm and the main model's output head. The
embedding and the head are the main model's (shared, not copied). Depth k sees positions 0 .. s-1-k of the
window: the last k tokens have no target k+1 steps ahead inside it.

The loss L_MTP = mtp_loss_weight / D * sum_k CE_k trains the modules and, through the shared pieces and h^0, the
main model. It is added to the next-token loss's gradient but not to its value (``with_extra_loss``), so the
step's ``loss`` stays the next-token loss users compare runs by; the MTP figures are reported beside it
(``begin_step`` / ``end_step``, the step record's ``mtp``). Inference (``generate``, evaluation) never runs
the modules: nothing is kept without gradients, so ``model_loss`` adds nothing there.

How it is wired: the family's forward hands ``keep`` the embedded tokens and h^0 (``forward_keeping``);
``workers.model.gpt.model_loss`` then calls the model's ``mtp_loss(targets, reduction)``, which FSDP2 gathers
around like a forward under ZeRO-2/3 (``workers.parallel.data_parallel``). Pipeline parallelism is refused
(``orchestrator/spec/checks/mtp.py``): the modules need the embedding, which lives on the first stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from workers.model.config import ModelConfig


class MTPLayer(nn.Module):
    """One depth, mixed into the family's block class (``class DeepseekMTP(MTPLayer, DeepseekBlock)``): the
    block's own submodules (so its parameters are named as a block's, ``mtp.{layer}.attention...``, and the
    checkpoint and expert-parallel code that matches block names applies), plus ``enorm``, ``hnorm``, ``eh_proj``
    (2d -> d) and ``norm`` before the shared head. ``layer`` is its global block index, ``n_layers + k - 1``."""

    def __init__(self, cfg: ModelConfig, layer: int, norm: type[nn.Module]):
        super().__init__(cfg, layer)
        d = cfg.d_model
        self.enorm, self.hnorm = norm(d, cfg.norm_eps), norm(d, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.norm = norm(d, cfg.norm_eps)

    def predict(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """h^k [b, L, d] from h^{k-1} and the embeddings of the tokens k ahead, both [b, L, d]: the block's forward
        on the projected concatenation."""
        return self(self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1)))


class MultiTokenPrediction(nn.ModuleDict):
    """The D depths by global block index (parameters ``mtp.{n_layers + k - 1}.*``), what the last training forward
    kept for them, and the step's tally of each depth's loss (summed token losses and counted targets)."""

    def __init__(self, cfg: ModelConfig, layer: type[MTPLayer], norm: type[nn.Module]):
        super().__init__({str(i): layer(cfg, i, norm) for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_layers)})
        self.weight = cfg.mtp_loss_weight
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None
        self.tally = torch.zeros(2, cfg.mtp_layers, dtype=torch.float64, device="cpu")  # also under a meta build

    def keep(self, embedded: torch.Tensor, hidden: torch.Tensor) -> None:
        """Hold a training forward's token embeddings and pre-norm hidden state for ``loss``; nothing is kept
        without gradients (generation, evaluation, a DPO reference pass)."""
        self.kept = (embedded, hidden) if torch.is_grad_enabled() else None

    def loss(self, head_loss, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        """L_MTP of the kept forward against ``targets`` [b, s] (``targets[:, i]`` is token i+1; -100 ignored):
        ``head_loss(hidden, targets, reduction)`` is the main model's head and cross entropy, so depth k's loss is
        reduced as the next-token loss is (a mean, or the sum a loss mask's objective scales)."""
        embedded, hidden = self.kept
        self.kept = None
        seq, total = targets.shape[1], 0.0
        for k, module in enumerate(self.values(), start=1):
            hidden = module.predict(hidden[:, :seq - k], embedded[:, k:])
            wanted = targets[:, k:]
            depth = head_loss(module.norm(hidden), wanted, reduction)
            self._count(k, depth, wanted, reduction)
            total = total + depth
        return total * (self.weight / len(self))

    @torch.no_grad()
    def _count(self, k: int, loss: torch.Tensor, targets: torch.Tensor, reduction: str) -> None:
        counted = int((targets != -100).sum())
        summed = float(loss) * (counted if reduction == "mean" else 1)
        self.tally[0, k - 1] += summed
        self.tally[1, k - 1] += counted


def with_extra_loss(loss: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """``loss`` in value, ``loss + extra`` in gradient: extra - extra.detach() is exactly zero, so the step's
    reported loss is the next-token loss while the backward trains ``extra`` with the same scale."""
    return loss + (extra - extra.detach())


def forward_keeping(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A whole model's forward (embedding, blocks, norm, head) that hands ``model.mtp`` the embeddings and the
    pre-norm hidden state; under ``train.loss_chunks`` > 1 it stops before the head as the GPT's does."""
    embedded = model.tok_embeddings(x)
    h = embedded
    for layer in model.layers.values():
        h = layer(h)
    model.mtp.keep(embedded, h)
    h = model.norm(h)
    return h if model.loss_chunks > 1 else model.output(h)


def mtp_parts(modules: list[nn.Module]) -> list[MultiTokenPrediction]:
    """The MTP module lists of this rank's model parts."""
    return [sub for module in modules for sub in module.modules() if isinstance(sub, MultiTokenPrediction)]


def begin_step(modules: list[nn.Module]) -> None:
    """Clear the tallies before a step's microbatches."""
    for part in mtp_parts(modules):
        part.tally.zero_()
        part.kept = None


def end_step(modules: list[nn.Module], dp_group: dist.ProcessGroup | None, device: torch.device) -> dict | None:
    """The step's MTP figures, summed over the data-parallel ranks (one all-reduce): each depth's mean token
    loss over the global batch (``depths``) and ``loss``, their weighted sum L_MTP = weight / D * sum; None
    where this rank holds no MTP modules."""
    parts = mtp_parts(modules)
    if not parts:
        return None
    tally = parts[0].tally.to(device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(tally, group=dp_group)
    means = (tally[0] / tally[1].clamp(min=1)).tolist()
    return {"loss": parts[0].weight / len(means) * sum(means), "depths": means}
