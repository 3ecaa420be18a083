"""Multi-token prediction written apart from ``workers/model/mtp.py``, from the DeepSeek-V3 report (section 2.2), as
a plain loop of torch functional ops over the model's own pieces (its embedding table, blocks, norm weights and
head): the unit test checks the model against it and the parity tests' single-process reference trains with it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.model.deepseek import DeepseekBlock


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def mtp_losses(model, tokens: torch.Tensor, targets: torch.Tensor,
               reduction: str = "mean") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the next-token loss, [CE_k for each depth k]): depth k normalises h^{k-1} (depth 0: the last block's output
    before the final norm) and the embedding of the token k ahead, projects [emb; h] (DeepSeek's eh_proj layout)
    from 2d to d, runs one DeepSeek block and predicts the token k+1 ahead through the main model's head, over the
    positions whose target lies in the window."""
    cfg, eps = model.cfg, model.cfg.norm_eps
    embedded = F.embedding(tokens, model.tok_embeddings.weight)
    h = embedded
    for block in model.layers.values():
        h = block(h)
    head = model.output.weight
    main = F.cross_entropy(F.linear(_rms(h, model.norm.weight, eps), head).flatten(0, 1).float(), targets.flatten(),
                           reduction=reduction)
    depths, seq = [], tokens.shape[1]
    for k in range(1, cfg.mtp_layers + 1):
        depth = model.mtp[str(cfg.n_layers + k - 1)]
        joined = torch.cat((_rms(embedded[:, k:], depth.enorm.weight, eps),
                            _rms(h[:, :seq - k], depth.hnorm.weight, eps)), dim=-1)
        h = DeepseekBlock.forward(depth, F.linear(joined, depth.eh_proj.weight))
        logits = F.linear(_rms(h, depth.norm.weight, eps), head)
        depths.append(F.cross_entropy(logits.flatten(0, 1).float(), targets[:, k:].flatten(), reduction=reduction))
    return main, depths


def mtp_objective(model, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The next-token loss in value, L_main + weight / D * sum CE_k in gradient (what a step reports and trains)."""
    main, depths = mtp_losses(model, tokens, targets)
    extra = model.cfg.mtp_loss_weight / len(depths) * sum(depths)
    return main + (extra - extra.detach())
