"""Expert parallelism: each rank of an ep group holds ``E / ep`` of a MoE layer's experts, tokens travel to them.

The ep group is carved out of the data-parallel ranks (``workers.contract.grid``: ranks of one model position
whose dp index differs only in ``dp % ep``). Every rank routes its own tokens (``workers.model.moe.Routing``),
then ``ExpertParallelDispatcher``:

1. sorts its assignments by global expert id and exchanges the per-expert counts (one ``all_to_all_single`` of
   ``E`` integers), so every rank knows how many rows it will receive from each peer for each local expert;
2. sends the token rows with ``all_to_all_single`` and variable splits (dropless routing gives any count,
   zero included), through the functional collectives' ``all_to_all_single_autograd``, whose backward is the
   reverse exchange, so gradients flow back to the sending rank's tokens and gates;
3. regroups the received rows expert-major, runs ``Experts.grouped`` on them, restores the source-major order,
   sends the results back, and combines them gate-weighted per token exactly as ``LocalDispatcher`` does.

Why our own: PyTorch has the collective but no MoE dispatch, and the libraries that do (torchtitan, Megatron,
DeepSpeed) bind it to their own MoE modules; this one is ~a page over the shared ``Routing``/``Experts`` contract.

Gradients of the expert weights: a rank's expert receives tokens from all ``ep`` ranks of its group, so its
gradient sums ``ep`` ranks' local-loss gradients. The dispatcher scales the experts' share of the backward by
``1 / ep`` (and the tokens' gradient back by ``ep``), so an expert's gradient is one rank's share like a dense
weight's, and the data-parallel wrapper's plain mean over the ``dp / ep`` ranks holding the same experts (the
expert-data-parallel group, ``edp``) gives the mean over all dp ranks a dense weight gets.

Expert tensor parallelism (``parallel.expert_tp``, Megatron's ``expert_tensor_parallel_size`` = tp): each
expert's w1/w3 keep a run of ``h / tp`` hidden columns and w2 the same rows on each tp rank (``split_hidden``).
The MoE layer is replicated over tp (``workers.parallel.gpt_parallel.moe_style``: under sequence parallelism its
input is gathered first), so every tp rank routes the same tokens and exchanges them over its own ep group, and
each expert sees each of its tokens once per tp rank, on its own slice of the hidden. The slices' outputs are
summed over tp before the gates weigh them (``_SumOverTP``: forward all-reduce, backward identity, Megatron's
``g``), so the router's gradient is whole and equal on every tp rank; the rows entering the experts get the tp
ranks' gradients summed (``_EnterTP``, Megatron's ``f``), so the tokens' gradient is whole too.

``shard_experts`` turns a built model (on meta or materialised) into this rank's share: each ``Experts`` keeps
its rows ``[first, first + num_local)`` and each MoE layer gets this dispatcher. ``apply_data_parallel``
(``workers.parallel.data_parallel``) then puts every ``Experts`` under a data-parallel wrapper of its own (over
``edp``) before the stage's (over dp), the way FSDP2 nests, so dense weights are reduced over dp and expert
weights over edp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from workers.model.moe import HIDDEN_DIM, Experts, MoELayer


def received_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``[ep, E_local]``: how many rows each peer sends to each of this rank's experts.

    ``counts`` is ``[E]``, the rows this rank sends to every global expert; expert ``e`` lives on group rank
    ``e // E_local``, so an equal-split all-to-all of the counts hands each rank its experts' columns.
    """
    ep = dist.get_world_size(group)
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out.view(ep, -1)


def expert_major(received: torch.Tensor) -> torch.Tensor:
    """Row order that turns the received buffer (source-major: peer, then local expert) into expert-major runs.

    ``Experts.grouped`` wants local expert j's rows as the j-th consecutive run, whoever sent them.
    """
    lengths = received.flatten()
    starts = torch.cumsum(lengths, 0) - lengths  # where chunk (peer, expert) begins in the received buffer
    lengths_em, starts_em = received.t().flatten(), starts.view_as(received).t().flatten()
    run_starts = torch.cumsum(lengths_em, 0) - lengths_em
    within = torch.arange(int(lengths.sum()), device=received.device) - torch.repeat_interleave(run_starts, lengths_em)
    return torch.repeat_interleave(starts_em, lengths_em) + within


def exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """All-to-all of ``rows`` with variable splits, differentiable (the backward sends gradients back)."""
    return all_to_all_single_autograd(rows.contiguous(), out_splits, in_splits, group)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` (see the module docstring on expert gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class _EnterTP(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the tp group (each rank's hidden slice gave part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverTP(torch.autograd.Function):
    """Sums the tp ranks' partial expert outputs; the backward passes the (tp-equal) gradient through."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class ExpertParallelDispatcher:
    """``dispatcher(x_flat, routing, experts) -> [T, d]`` over an ep process group (see the module docstring);
    ``tp_group``: the tp group each expert's hidden is split over (expert tensor parallelism), else None.

    A plain callable like ``LocalDispatcher``, which it replaces on each MoE layer.
    """

    def __init__(self, group, tp_group=None):
        self.group, self.tp_group = group, tp_group

    def __call__(self, x: torch.Tensor, routing, experts) -> torch.Tensor:
        ep = dist.get_world_size(self.group)
        order = torch.argsort(routing.expert, stable=True)
        token, expert, gate = routing.token[order], routing.expert[order], routing.gate[order]
        counts = torch.bincount(expert, minlength=experts.num_experts)
        received = received_counts(counts, self.group)
        sent_splits = counts.view(ep, -1).sum(1).tolist()
        received_splits = received.sum(1).tolist()
        arrived = exchange(x[token], received_splits, sent_splits, self.group)
        regroup = expert_major(received)
        keys = self._keys(routing, token, received_splits, sent_splits)
        done = self._experts(experts, _ScaleGrad.apply(arrived[regroup], float(ep)), received.sum(0),
                             keys[regroup] if keys is not None else None)
        done = _ScaleGrad.apply(done, 1.0 / ep)
        back = exchange(done[torch.argsort(regroup)], sent_splits, received_splits, self.group)
        out = torch.zeros_like(x)
        return out.index_add(0, token, back * gate.unsqueeze(1).to(back.dtype))

    def _experts(self, experts, rows: torch.Tensor, counts: torch.Tensor, keys) -> torch.Tensor:
        """``experts.grouped`` on the arrived rows; under expert tensor parallelism each tp rank's hidden slice
        gives part of every row's output, summed over tp here (see the module docstring)."""
        if self.tp_group is None:
            return experts.grouped(rows, counts, keys)
        return _SumOverTP.apply(experts.grouped(_EnterTP.apply(rows, self.tp_group), counts, keys), self.tp_group)

    def _keys(self, routing, token: torch.Tensor, received_splits: list[int], sent_splits: list[int]):
        """The arriving rows' expert-dropout keys (``Routing.token_keys``), sent along with the rows; None
        where dropout is off."""
        if routing.token_keys is None:
            return None
        out = torch.empty(sum(received_splits), dtype=torch.int64, device=token.device)
        dist.all_to_all_single(out, routing.token_keys[token].contiguous(), received_splits, sent_splits,
                               group=self.group)
        return out


def experts_modules(module: nn.Module) -> list[nn.Module]:
    """The ``Experts`` (routed experts: ``num_experts``/``first``/``num_local``) under ``module``, in order."""
    return [m for m in module.modules() if isinstance(m, Experts)]


def shard_experts(module: nn.Module, ep_group, tp_group=None) -> list[nn.Module]:
    """Keep this rank's experts of every MoE layer under ``module`` and dispatch over ``ep_group``; with
    ``tp_group`` (expert tensor parallelism) also only this tp rank's slice of each expert's hidden.

    Works on meta (before ``materialize``, which then draws each full stack and keeps these rows) or on real
    weights. Returns the sharded ``Experts`` modules.
    """
    for layer in (m for m in module.modules() if isinstance(m, MoELayer)):
        keep_rows(layer.experts, dist.get_rank(ep_group), dist.get_world_size(ep_group))
        if tp_group is not None:
            split_hidden(layer.experts, dist.get_rank(tp_group), dist.get_world_size(tp_group))
        layer.dispatcher = ExpertParallelDispatcher(ep_group, tp_group)
    return experts_modules(module)


def split_hidden(experts: nn.Module, index: int, tp: int) -> None:
    """Cut each expert of ``experts`` to the ``index``-th of ``tp`` equal runs of its hidden units: w1/w3's
    columns, w2's rows (on meta: shapes only)."""
    width = experts.hidden // tp
    experts.first_unit = index * width
    for name, param in list(experts.named_parameters(recurse=False)):
        part = param.narrow(HIDDEN_DIM[name], experts.first_unit, width).detach().clone()
        setattr(experts, name, nn.Parameter(part, requires_grad=param.requires_grad))


def keep_rows(experts: nn.Module, index: int, ep: int) -> None:
    """Cut ``experts`` to the ``index``-th of ``ep`` equal runs of experts (on meta: shapes only)."""
    local = experts.num_experts // ep
    experts.first, experts.num_local = index * local, local
    for name, param in list(experts.named_parameters(recurse=False)):
        rows = param[experts.first:experts.first + local].detach().clone()
        setattr(experts, name, nn.Parameter(rows, requires_grad=param.requires_grad))
