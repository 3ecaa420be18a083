"""Mixture-of-experts feed-forward: the six routers, stacked experts, and the dispatch seam.

Why our own code: no well-kept library has the seed articles' routers (noisy top-k, GShard, Switch, expert
choice) behind one interface that also lets expert parallelism replace the dispatch (DESIGN.md lists MoE
routers and expert dispatch as raymesh's own).

The pieces, and the contract expert parallelism (``workers.parallel.expert_parallel``) plugs into:

- a ``Router`` scores the flattened tokens of one microbatch, split into routing groups (one per sequence under
  ``group: sequence``, one per microbatch under ``group: microbatch``), and returns a ``Routing``: the kept
  (token, expert, gate) assignments, its weighted auxiliary losses and detached figures. Capacity and every
  auxiliary loss are computed per group and averaged over the groups, so with ``group: sequence`` a token's
  fate and the loss gradient do not depend on which rank holds which sequences (data-parallel parity);
- ``Experts`` holds the experts' weights stacked ([E_local, d, h]); ``grouped`` runs expert j on the j-th run
  of rows;
- the layer's ``dispatcher`` (``LocalDispatcher`` here; expert parallelism swaps in its all-to-all one) sends
  each kept assignment's token to its expert and scatter-adds the gate-weighted result per token. A token left
  with no assignment contributes nothing: the block's residual carries it.

Randomness (noisy top-k's noise, GShard's random second expert) is drawn per sequence from a generator seeded by
(job seed, layer, the sequence's position in the global data stream), so it is the same on every layout and in
a recompute. Expert dropout's mask is a hash of (seed, layer, expert, the token's stream position, hidden unit)
(``keyed_dropout``), so it does not depend on where the token's expert runs either. Auxiliary losses reach the
gradient through ``AuxLossGrad`` (the layer's output is unchanged, its backward adds d(aux)/d(router)), so
they work inside pipeline stages without threading a second loss through the schedule; the step's reported loss
stays the language-model loss and the auxiliary ones are reported apart.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.model.config import ModelConfig, MoEConfig
from workers.model.ec_dykstra import capped_choice, dykstra_assignment
from workers.model.names import plain_name


@dataclass
class Routing:
    """One routing decision for a flattened batch of T tokens; dropped assignments are absent."""

    token: torch.Tensor  # LongTensor [A]: index of the token (0..T-1) in the flattened (T, d) input
    expert: torch.Tensor  # LongTensor [A]: GLOBAL expert id (0..E-1) of that assignment
    gate: torch.Tensor  # float [A]: weight applied to that expert's output for that token
    losses: dict[str, torch.Tensor] = field(default_factory=dict)  # weighted auxiliary losses (added to the loss)
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # detached: tokens_per_expert [E], dropped, ...
    token_keys: torch.Tensor | None = None  # int64 [T]: each token's dropout key (``SequenceNoise.token_keys``)
    # ``balance_loss: pooled``: the group's [G, E] choice fractions f (detached) and mean probabilities P, pooled
    # with the other layers' by ``BalancePool`` instead of a per-layer balance loss
    pooled: tuple[torch.Tensor, torch.Tensor] | None = None


# -- experts ---------------------------------------------------------------------------------------------------

def expert_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor | None,
               dropout: float, training: bool, keys: torch.Tensor | None = None, first_unit: int = 0) -> torch.Tensor:
    """One expert: ``w2(gelu(x w1))`` (GPT) or ``w2(silu(x w1) * x w3)`` (Llama's SwiGLU), dropout on the hidden
    (keyed by the rows' ``keys`` where given, see ``keyed_dropout``; ``first_unit``: the global index of the
    hidden's first unit, where expert tensor parallelism holds a slice of it)."""
    hidden = F.silu(x @ w1) * (x @ w3) if w3 is not None else F.gelu(x @ w1)
    return _dropout(hidden, dropout, training, keys, first_unit) @ w2


def _dropout(hidden: torch.Tensor, p: float, training: bool, keys: torch.Tensor | None,
             first_unit: int = 0) -> torch.Tensor:
    if keys is None or p == 0 or not training:
        return F.dropout(hidden, p, training)
    return keyed_dropout(hidden, keys, p, first_unit)


_BITS31 = 0x7FFFFFFF


def hash31(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash of int64 ``x`` (Wellons' lowbias32 rounds on 31 bits, so products stay below 2**63)."""
    for multiplier in (0x7FEB352D, 0x846CA68B):
        x = x & _BITS31
        x = (x ^ (x >> 16)) * multiplier
    x = x & _BITS31
    return x ^ (x >> 16)


def mix(key: torch.Tensor | int, value: torch.Tensor | int) -> torch.Tensor:
    """A new 31-bit key from ``key`` and a non-negative int64 ``value`` of any size (its three 31-bit chunks)."""
    key = torch.as_tensor(key, dtype=torch.int64)
    value = torch.as_tensor(value, dtype=torch.int64)
    for shift in (0, 31, 62):
        key = hash31(key + ((value >> shift) & _BITS31))
    return key


def keyed_dropout(hidden: torch.Tensor, keys: torch.Tensor, p: float, first_unit: int = 0) -> torch.Tensor:
    """Dropout of ``hidden`` [N, h] whose mask is a hash of each row's key and the hidden unit, not a draw from the
    global RNG: an expert's row is dropped the same way wherever (and in whichever order) its token arrives.

    Why not ``torch.Generator`` per row as ``SequenceNoise`` does per sequence: one generator per token copy and
    expert is far too slow; the counter-based hash is a few vectorised integer ops on [N, h]. ``first_unit``: the
    global index of ``hidden``'s first column (a tp rank's slice under expert tensor parallelism draws its part of
    the whole hidden's mask).
    """
    units = torch.arange(first_unit, first_unit + hidden.shape[-1], device=hidden.device)
    draws = hash31(keys.to(hidden.device).unsqueeze(-1) + units * 0x9E3779B1)
    keep = draws >= int(p * (_BITS31 + 1))
    return hidden * keep.to(hidden.dtype) / (1.0 - p)


class _StackedFFN(nn.Module):
    """``count`` feed-forwards with their weights stacked on dim 0 (w1, w3: [count, d, h]; w2: [count, h, d])."""

    def __init__(self, count: int, d_model: int, hidden: int, swiglu: bool, dropout: float):
        super().__init__()
        self.dropout = dropout
        self.w1 = nn.Parameter(torch.empty(count, d_model, hidden))
        self.w2 = nn.Parameter(torch.empty(count, hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(count, d_model, hidden)) if swiglu else None
        self.first_unit = 0  # global index of the hidden's first unit held here (expert tensor parallelism)

    def one(self, j: int, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        """Feed-forward ``j`` (local index) on rows ``x`` (dropout keyed by ``keys`` where given)."""
        return expert_ffn(x, self.w1[j], self.w2[j], None if self.w3 is None else self.w3[j],
                          self.dropout, self.training, keys, self.first_unit)


HIDDEN_DIM = {"w1": 2, "w3": 2, "w2": 1}  # the hidden dim of each stacked weight ([E, d, h] and [E, h, d])


@dataclass(frozen=True)
class HeldRows:
    """Rows ``start .. start + local`` of a stacked parameter whose full first dimension is ``full``; under expert
    tensor parallelism (``hidden_full`` set) also hidden units ``hidden_start .. + local`` of ``hidden_full``."""

    full: int
    start: int
    hidden_full: int | None = None
    hidden_start: int = 0

    def full_shape(self, weight: str, local: tuple) -> tuple:
        """The full stack's shape of stacked weight ``weight`` (``w1``, ``w2``, ``w3``) held as ``local``."""
        shape = [self.full, *local[1:]]
        if self.hidden_full is not None:
            shape[HIDDEN_DIM[weight]] = self.hidden_full
        return tuple(shape)

    def cut(self, weight: str, full: torch.Tensor, local: tuple) -> torch.Tensor:
        """This module's part (of shape ``local``) of the full stack ``full`` of ``weight``."""
        part = full[self.start:self.start + local[0]]
        if self.hidden_full is None:
            return part
        dim = HIDDEN_DIM[weight]
        return part.narrow(dim, self.hidden_start, local[dim])


class Experts(_StackedFFN):
    """The routed experts of one MoE layer, or this rank's slice of them under expert parallelism.

    ``num_experts`` is the global count E, ``first`` the global id of local expert 0, ``num_local`` how many are
    held here (expert parallelism slices the stacked weights and sets ``first``/``num_local``).
    """

    grouped_gemm = True  # whether ``_grouped_mm`` computes what ``one`` does (a subclass with another FFN: False)

    def __init__(self, num_experts: int, d_model: int, hidden: int, swiglu: bool, dropout: float = 0.0):
        super().__init__(num_experts, d_model, hidden, swiglu, dropout)
        self.num_experts, self.first, self.num_local, self.hidden = num_experts, 0, num_experts, hidden

    @property
    def held_rows(self) -> HeldRows:
        """Which rows of the full [E, ...] stacks this module holds: meta-device init draws the full stack (one
        generator per name, so values do not depend on the split) and keeps these rows."""
        split = self.w1.shape[2] != self.hidden
        return HeldRows(full=self.num_experts, start=self.first, hidden_full=self.hidden if split else None,
                        hidden_start=self.first_unit)

    def grouped(self, x_sorted: torch.Tensor, counts: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        """Local expert j applied to the j-th consecutive run of ``counts[j]`` rows of ``x_sorted`` [N, d].

        ``keys`` (int64 [N], the rows' tokens' ``token_keys``) key expert dropout; they are mixed with each
        row's global expert id here."""
        keys = self.expert_keys(keys, counts)
        if _grouped_mm_applies(x_sorted, self):
            return self._grouped_mm(x_sorted, counts, keys)
        runs, sizes = x_sorted.split(counts.tolist()), counts.tolist()
        run_keys = keys.split(sizes) if keys is not None else [None] * len(sizes)
        out = [self.one(j, rows, k) for j, (rows, k) in enumerate(zip(runs, run_keys, strict=True))]
        return torch.cat(out) if out else x_sorted[:0]

    def expert_keys(self, keys: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor | None:
        """Each row's dropout key mixed with its global expert id (None where dropout is off)."""
        if keys is None or self.dropout == 0 or not self.training:
            return None
        expert = torch.repeat_interleave(torch.arange(self.first, self.first + len(counts), device=keys.device),
                                         counts.to(keys.device))
        return mix(keys, expert)

    def _grouped_mm(self, x: torch.Tensor, counts: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
        """All experts in three grouped GEMMs (CUDA, bf16): ``torch._grouped_mm`` with the runs' end offsets."""
        offsets = counts.cumsum(0).to(torch.int32)
        w1, w2 = self.w1.to(x.dtype), self.w2.to(x.dtype)
        gate = torch._grouped_mm(x, w1, offs=offsets)
        if self.w3 is not None:
            hidden = F.silu(gate) * torch._grouped_mm(x, self.w3.to(x.dtype), offs=offsets)
        else:
            hidden = F.gelu(gate)
        hidden = _dropout(hidden, self.dropout, self.training, keys, self.first_unit)
        return torch._grouped_mm(hidden, w2, offs=offsets)


def _grouped_mm_applies(x: torch.Tensor, experts: Experts) -> bool:
    """``torch._grouped_mm`` needs CUDA, bf16 and 16-byte aligned rows; elsewhere the per-expert loop runs."""
    d, h = experts.w1.shape[1], experts.w1.shape[2]
    return (experts.grouped_gemm and hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and d % 8 == 0 and h % 8 == 0)


class SharedExperts(_StackedFFN):
    """Always-on experts (DeepSeek's shared experts): every token passes all of them, gate 1.

    Not an ``Experts``: they are dense (every rank holds all of them), so expert parallelism leaves them alone.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(self.one(j, x) for j in range(self.w1.shape[0]))


class LocalDispatcher:
    """Dispatch and combine in this process: the one place expert parallelism swaps for its all-to-all version.

    A plain object, not a module, so a layer's ``dispatcher`` can be replaced by any callable.
    """

    def __call__(self, x_flat: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        order = torch.argsort(routing.expert, stable=True)
        token = routing.token[order]
        counts = torch.bincount(routing.expert - experts.first, minlength=experts.num_local)
        keys = routing.token_keys[token] if routing.token_keys is not None else None
        out = experts.grouped(x_flat[token], counts, keys)
        out = out * routing.gate[order].unsqueeze(-1).to(out.dtype)
        return torch.zeros_like(x_flat).index_add_(0, token, out.to(x_flat.dtype))


# -- randomness that does not depend on the layout ----------------------------------------------------------

@dataclass
class SequenceNoise:
    """Random draws for one microbatch, made per sequence from (seed, layer, global stream position).

    ``first_sequence`` is the data-stream position of the microbatch's first sequence (the trainer sets it),
    so sequence i of any rank draws what it draws in the single-process reference.
    """

    seed: int
    layer: int
    first_sequence: int
    batch: int
    seq_len: int

    def _generator(self, i: int) -> torch.Generator:
        digest = hashlib.sha256(f"moe:{self.seed}:{self.layer}:{self.first_sequence + i}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))

    def _draw(self, fill, width: int, device: torch.device) -> torch.Tensor:
        rows = [fill(torch.empty(self.seq_len, width), self._generator(i)) for i in range(self.batch)]
        return torch.cat(rows).to(device)

    def normal(self, width: int, device: torch.device) -> torch.Tensor:
        """[batch * seq_len, width] standard normal draws."""
        return self._draw(lambda t, g: t.normal_(generator=g), width, device)

    def uniform(self, device: torch.device) -> torch.Tensor:
        """[batch * seq_len] U(0, 1) draws."""
        return self._draw(lambda t, g: t.uniform_(generator=g), 1, device).squeeze(-1)

    def token_keys(self, device: torch.device) -> torch.Tensor:
        """int64 [batch * seq_len]: each token's key for expert dropout, from (seed, layer, its stream position)."""
        position = self.first_sequence * self.seq_len + torch.arange(self.batch * self.seq_len, device=device)
        return mix(mix(self.seed, self.layer), position)


# -- routers ---------------------------------------------------------------------------------------------------

def cv_squared(x: torch.Tensor) -> torch.Tensor:
    """Squared coefficient of variation over the last dim (population variance / mean²), per group."""
    return x.float().var(-1, unbiased=False) / (x.float().mean(-1) ** 2 + 1e-10)


def within_capacity(choices: torch.Tensor, wanted: torch.Tensor, capacity: int, experts: int) -> torch.Tensor:
    """Which wanted assignments fit: each expert takes at most ``capacity`` per group, first choices before
    second choices, and within a choice rank earlier tokens first (GShard's and Switch's order).

    ``choices``/``wanted``: [G, n, k] expert ids and whether the router asks for them; returns the kept mask.
    """
    g, n, k = choices.shape
    queue = F.one_hot(choices, experts) * wanted.unsqueeze(-1)  # [G, n, k, E]
    queue = queue.transpose(1, 2).reshape(g, k * n, experts)  # choice rank major, token minor
    position = ((queue.cumsum(1) - 1) * queue).sum(-1)
    kept = (position < capacity) & queue.sum(-1).bool()
    return kept.view(g, k, n).transpose(1, 2)


class Router(nn.Module):
    """Scores tokens against experts with ``weight`` [E, d] in float32 (Switch's selective precision, kept for
    every router since it is cheap) and decides the routing. Subclasses implement ``decide``."""

    def __init__(self, cfg: MoEConfig, d_model: int):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.experts, d_model))
        # under context parallelism (set by the builder): the cp group holding the rest of each sequence's tokens,
        # over which ``router: topk``'s balance loss is formed (``over_context``); None otherwise
        self.context_group = None

    def logits(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """[G, n, d] -> float32 [G, n, E], outside any autocast."""
        weight = self.weight if weight is None else weight
        with torch.autocast(x.device.type, enabled=False):
            return x.float() @ weight.float().t()

    def forward(self, x: torch.Tensor, noise: SequenceNoise) -> Routing:
        logits = self.logits(x)
        routing = self.decide(x, logits, noise)
        if self.cfg.z_loss_weight > 0:
            routing.losses["z"] = self.cfg.z_loss_weight * torch.logsumexp(logits, -1).pow(2).mean()
        return routing

    def decide(self, x: torch.Tensor, logits: torch.Tensor, noise: SequenceNoise) -> Routing:
        raise NotImplementedError

    def balanced(self, probs: torch.Tensor, choices: torch.Tensor, gates: torch.Tensor) -> Routing:
        """The dropless ``Routing`` of [G, n, k] ``choices`` with their ``gates``, and Switch's balance loss over the
        softmax ``probs`` [G, n, E]: per layer, or handed to the model's pool (``balance_loss: pooled``); under cp
        formed over whole sequences (``context_group``: the cp shares' counts summed)."""
        losses, pooled = {}, None
        if self.cfg.aux_loss_weight > 0 and self.cfg.balance_loss == "pooled":
            pooled = over_context(choice_fractions(choices, self.cfg.experts), probs.mean(1), self.context_group)
        elif self.cfg.aux_loss_weight > 0:
            losses["balance"] = load_balance_loss(probs, choices, self.cfg.aux_loss_weight, self.context_group)
        routing = self.token_choice(choices, gates, torch.ones_like(choices, dtype=torch.bool), None, losses)
        routing.pooled = pooled
        return routing

    def token_choice(self, choices: torch.Tensor, gates: torch.Tensor, wanted: torch.Tensor,
                     capacity: int | None, losses: dict[str, torch.Tensor]) -> Routing:
        """A ``Routing`` from each token's [G, n, k] choices and gates: capacity applied when given."""
        kept = wanted if capacity is None else within_capacity(choices, wanted, capacity, self.cfg.experts)
        g, n, k = choices.shape
        token = torch.arange(g * n, device=choices.device).view(g, n, 1).expand(g, n, k)
        expert = choices[kept]
        stats = {"tokens_per_expert": torch.bincount(expert, minlength=self.cfg.experts).float(),
                 "dropped": (wanted.sum() - kept.sum()).float(), "assignments": wanted.sum().float()}
        return Routing(token[kept], expert, gates[kept], losses, stats)


def choice_fractions(chosen: torch.Tensor, experts: int) -> torch.Tensor:
    """[G, E]: the fraction of each group's tokens that chose expert i among their k (``chosen``: [G, n, k])."""
    return F.one_hot(chosen, experts).sum(2).float().mean(1)


def load_balance_loss(probs: torch.Tensor, chosen: torch.Tensor, weight: float, context=None) -> torch.Tensor:
    """Switch's α·E·Σ_i f_i·P_i per group, averaged over groups: f_i the fraction of the group's tokens that
    chose expert i (among their k), P_i the mean router probability of i. ``chosen``: [G, n, k] expert ids.
    ``context``: the cp group holding the rest of each group's tokens (``over_context``), or None."""
    experts = probs.shape[-1]
    fractions, mean_probs = over_context(choice_fractions(chosen, experts), probs.mean(1), context)
    return weight * experts * (fractions * mean_probs).sum(-1).mean()


class _MeanOverContext(torch.autograd.Function):
    """The mean of a [G, E] figure over the cp ranks; the backward passes the gradient through unchanged.

    Why unchanged: every cp rank forms the same whole-sequence loss from the mean, so d loss / d mean is equal on
    all of them; the true gradient to a rank's share is that over cp, and the data-parallel reduction (a mean over
    dp x cp) divides the cp ranks' sum by cp once more, so passing it through gives exactly the single-process
    gradient once averaged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out / dist.get_world_size(group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def over_context(fractions: torch.Tensor, probs: torch.Tensor, context) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole routing groups' choice fractions and mean probabilities ([G, E] each) from this cp rank's share
    of their tokens: context parallelism gives every cp rank an equal share of each sequence, so the whole
    group's means are the means over cp of the shares'. ``context``: the cp group, or None (nothing to do)."""
    if context is None:
        return fractions, probs
    whole = fractions.detach().contiguous().clone()
    dist.all_reduce(whole, group=context)
    return whole / dist.get_world_size(context), _MeanOverContext.apply(probs, context)


class BalancePool:
    """``model.moe.balance_loss: pooled``: the balance loss of ``transformers``' ``load_balancing_loss_func``
    (Mixtral, Qwen3-MoE), α·E·Σ_i F_i·P̄_i with F and P̄ the choice fractions and mean probabilities averaged over
    *all* MoE layers before their product, where raymesh's per-layer loss sums one product per layer.

    One pool is shared by a model's MoE layers (``share_balance_pool``). Each layer adds its [G, E] f (detached)
    and P (in the graph) as it runs; the model's last MoE layer forms the loss from all of them and attaches it to
    its own output, so the backward reaches every layer's router through its P. Per routing group, averaged over
    the groups (``group: microbatch`` over one forward is exactly transformers' figure). Needs every MoE layer in
    one process: a pipeline stage holding the last MoE layer without the others is refused here (and by the spec).
    """

    def __init__(self, layers: list[int], weight: float):
        self.layers, self.weight = layers, weight
        self.parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, layer: int, f: torch.Tensor, probs: torch.Tensor) -> torch.Tensor | None:
        """Keep layer ``layer``'s f and P for this forward; at the model's last MoE layer, the pooled loss."""
        if layer == self.layers[0]:
            self.parts = {}
        self.parts[layer] = (f, probs)
        if layer != self.layers[-1]:
            return None
        missing = sorted(set(self.layers) - set(self.parts))
        if missing:
            raise RuntimeError(f"model.moe.balance_loss: pooled needs every MoE layer's routing in this process, "
                               f"and layers {missing} ran elsewhere (a pipeline stage); set model.moe.balance_loss: "
                               "per_layer under parallel.pp > 1")
        fractions = torch.stack([f for f, _ in self.parts.values()]).mean(0)
        probs = [p for _, p in self.parts.values()]
        self.parts = {}
        return PooledBalance.apply(self.weight, fractions, *probs)


class PooledBalance(torch.autograd.Function):
    """α·E·mean_g Σ_i F_gi·mean_l P_lgi from the pooled fractions F (constants) and each layer's P; its gradient to
    P_l is α·E·F / (L·G) whatever P is, so nothing is saved for backward: the layer that forms it may sit in a
    recomputed block, whose recompute must save what its forward saved (and it does not form the loss again)."""

    @staticmethod
    def forward(ctx, weight: float, fractions: torch.Tensor, *probs: torch.Tensor) -> torch.Tensor:
        experts, groups = fractions.shape[-1], fractions.shape[0]
        ctx.grad = fractions * (weight * experts / (len(probs) * groups))  # an attribute: no saved-tensor hooks
        return weight * experts * (fractions * torch.stack(probs).mean(0)).sum(-1).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, None, *[grad * ctx.grad] * (len(ctx.needs_input_grad) - 2))


def share_balance_pool(model: nn.Module) -> None:
    """Give ``model``'s MoE layers one ``BalancePool`` when its config asks for the pooled balance loss."""
    layers = {sub.layer: sub for sub in model.modules() if isinstance(sub, MoELayer)}
    moe = next(iter(layers.values())).cfg if layers else None
    if moe is None or moe.balance_loss != "pooled" or moe.aux_loss_weight == 0:
        return
    pool = BalancePool(sorted(layers), moe.aux_loss_weight)
    for layer in layers.values():
        layer.pool = pool


class TopKRouter(Router):
    """Plain softmax top-k, dropless (Mixtral, Qwen3-MoE): gates are the chosen probabilities, renormalised to sum
    to one unless ``norm_topk`` is off (Qwen3-MoE's ``norm_topk_prob: false``); Switch-style balance loss. With
    ``bias_balancing`` (DeepSeek-V3's auxiliary-loss-free balancing) a per-expert ``bias`` is added to the scores
    for the choice only (gates use the unbiased probabilities), and ``update_bias`` moves it after each step
    against the sign of the load error, outside autograd."""

    def __init__(self, cfg: MoEConfig, d_model: int):
        super().__init__(cfg, d_model)
        self.register_buffer("bias", torch.zeros(cfg.experts))

    def reset_buffers(self) -> None:
        """Meta-device init: the balancing bias starts at zero."""
        self.bias = torch.zeros(self.cfg.experts, device=self.weight.device)

    def decide(self, x: torch.Tensor, logits: torch.Tensor, noise: SequenceNoise) -> Routing:
        probs = logits.softmax(-1)
        choices = (probs + self.bias).topk(self.cfg.k, -1).indices
        gates = probs.gather(-1, choices)
        if self.cfg.norm_topk:
            gates = gates / gates.sum(-1, keepdim=True)
        return self.balanced(probs, choices, gates)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """bias_i += rate * sign(mean load - load_i): underloaded experts become likelier picks."""
        if self.cfg.bias_balancing:
            self.bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load).to(self.bias)


class SigmoidRouter(TopKRouter):
    """DeepSeek-V3: scores sigmoid(x W_g); the choice adds the balancing ``bias`` (``bias_balancing``, moved by
    load after each step, never by gradient) and, with ``groups`` > 1, keeps only each token's ``top_groups`` best
    groups of experts (a group scores the sum of its two best biased scores); gates are the unbiased scores of
    the k chosen, renormalised (``norm_topk``) and times ``gate_scale``. Dropless. Its balance loss is the paper's
    sequence-wise one, w·Σ_i f_i·P_i with f_i = E/(k·n)·(tokens choosing i), P_i the mean of the scores
    normalised per token (the paper's α is tiny: the bias does the balancing)."""

    def decide(self, x: torch.Tensor, logits: torch.Tensor, noise: SequenceNoise) -> Routing:
        scores = logits.sigmoid()
        choices = self.group_limited(scores + self.bias).topk(self.cfg.k, -1).indices
        gates = scores.gather(-1, choices)
        if self.cfg.norm_topk:
            gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
        losses = {}
        if self.cfg.aux_loss_weight > 0:
            f = choice_fractions(choices, self.cfg.experts) * self.cfg.experts / self.cfg.k
            p = (scores / scores.sum(-1, keepdim=True)).mean(1)
            losses["balance"] = self.cfg.aux_loss_weight * (f * p).sum(-1).mean()
        return self.token_choice(choices, gates * self.cfg.gate_scale, torch.ones_like(choices, dtype=torch.bool),
                                 None, losses)

    def group_limited(self, biased: torch.Tensor) -> torch.Tensor:
        """``biased`` [G, n, E] with the experts outside each token's ``top_groups`` best groups at -inf."""
        groups, top = self.cfg.groups, self.cfg.top_groups or self.cfg.groups
        if groups == 1 or top >= groups:
            return biased
        grouped = biased.unflatten(-1, (groups, -1))
        best = grouped.topk(min(2, grouped.shape[-1]), -1).values.sum(-1).topk(top, -1).indices
        kept = torch.zeros(grouped.shape[:-1], dtype=torch.bool, device=biased.device).scatter(-1, best, True)
        return grouped.masked_fill(~kept.unsqueeze(-1), -math.inf).flatten(-2)


class NoisyTopKRouter(Router):
    """Shazeer et al. 2017: H = x W_g + ε·softplus(x W_noise), ε ~ N(0, 1) (training only); gates =
    softmax(KeepTopK(H, k)); dropless. Losses: importance w·CV(Σ_x G(x))² and load w·CV(Σ_x P(x, i))², with
    P(x, i) = Φ(((x W_g)_i - kth_excluding(H, k, i)) / softplus((x W_noise)_i)). Both matrices start at zero,
    as in the paper (no signal, some noise)."""

    def __init__(self, cfg: MoEConfig, d_model: int):
        super().__init__(cfg, d_model)
        self.noise_weight = nn.Parameter(torch.empty(cfg.experts, d_model))

    def decide(self, x: torch.Tensor, logits: torch.Tensor, noise: SequenceNoise) -> Routing:
        k, noisy = self.cfg.k, self.training
        scores, std = logits, None
        if noisy:
            std = F.softplus(self.logits(x, self.noise_weight))
            scores = logits + noise.normal(self.cfg.experts, x.device).view_as(logits) * std
        top = scores.topk(min(k + 1, self.cfg.experts), -1)
        choices = top.indices[..., :k]
        gates = top.values[..., :k].softmax(-1)
        dense = torch.zeros_like(logits).scatter(-1, choices, gates)  # G(x) over all experts
        losses = {}
        if self.cfg.aux_loss_weight > 0:
            w = self.cfg.aux_loss_weight
            losses["importance"] = w * cv_squared(dense.sum(1)).mean()
            losses["load"] = w * cv_squared(self._load(logits, scores, std, top.values, dense)).mean()
        return self.token_choice(choices, gates, torch.ones_like(choices, dtype=torch.bool), None, losses)

    def _load(self, clean, noisy, std, top_values, dense) -> torch.Tensor:
        """Σ_x P(x, i) per group: the smooth load estimator (the count of routed tokens without noise)."""
        if std is None:
            return (dense > 0).float().sum(1)
        k = self.cfg.k
        kth = top_values[..., k - 1:k]
        after = top_values[..., k:k + 1] if top_values.shape[-1] > k else torch.full_like(kth, -math.inf)
        in_top = noisy >= kth
        threshold = torch.where(in_top, after, kth)  # kth greatest of H excluding component i
        # unvalidated: a pipeline stage's shape probe runs on uninitialised input, which the check refuses
        p = torch.distributions.Normal(0.0, 1.0, validate_args=False).cdf((clean - threshold) / std)
        return p.sum(1)


class GShardRouter(Router):
    """Lepikhin et al. 2020: top-2 of softmax(x W_g), gates renormalised over the two; the second expert is kept
    only with probability 2·g2 (random routing); per-group expert capacity, first choices queued before second
    ones; aux loss w·mean_e(c_e/n · m_e) with c_e the group's top-1 count and m_e its mean gate."""

    def decide(self, x: torch.Tensor, logits: torch.Tensor, noise: SequenceNoise) -> Routing:
        g, n, experts = logits.shape
        probs = logits.softmax(-1)
        top = probs.topk(2, -1)
        choices, gates = top.indices, top.values / top.values.sum(-1, keepdim=True)
        wanted = torch.ones_like(choices, dtype=torch.bool)
        if self.training:
            wanted[..., 1] = 2 * gates[..., 1] > noise.uniform(x.device).view(g, n)
        losses = {}
        if self.cfg.aux_loss_weight > 0:
            first = F.one_hot(choices[..., 0], experts).float().mean(1)
            losses["balance"] = self.cfg.aux_loss_weight * (first * probs.mean(1)).mean(-1).mean()
        return self.token_choice(choices, gates, wanted, self.cfg.capacity(n, 2), losses)


class SwitchRouter(Router):
    """Fedus et al. 2021: top-1 of softmax(x W_g) (gate = that probability), capacity ceil(c·n/E) per group,
    aux loss α·E·Σ f_i·P_i; router in float32; truncated-normal init with scale 0.1 (``moe_parameter``)."""

    def decide(self, x: torch.Tensor, logits: torch.Tensor, noise: SequenceNoise) -> Routing:
        n = logits.shape[1]
        probs = logits.softmax(-1)
        top = probs.topk(1, -1)
        losses = {}
        if self.cfg.aux_loss_weight > 0:
            losses["balance"] = load_balance_loss(probs, top.indices, self.cfg.aux_loss_weight)
        wanted = torch.ones_like(top.indices, dtype=torch.bool)
        return self.token_choice(top.indices, top.values, wanted, self.cfg.capacity(n, 1), losses)


class ExpertChoiceRouter(Router):
    """Zhou et al. 2022: S = softmax(x W_g); each expert takes its top-k tokens of the group by S, k = n·c/e
    (c = capacity_factor), gate S; every expert gets exactly k tokens; a token no expert picks is dropped
    (carried by the residual). No balance loss (the load is balanced by construction). With
    ``max_experts_per_token`` (b) the picks come from the entropy-regularised assignment with at most b experts
    per token (``workers.model.ec_dykstra``): an expert then takes at most k tokens, a token at most b experts."""

    def tokens_per_expert(self, n: int) -> int:
        """k = n·c/e, at least one and at most the group's n tokens."""
        return max(1, min(n, int(n * self.cfg.capacity_factor / self.cfg.experts)))

    def decide(self, x: torch.Tensor, logits: torch.Tensor, noise: SequenceNoise) -> Routing:
        g, n, experts = logits.shape
        if self.cfg.max_experts_per_token is not None:
            return self._decide_capped(logits.softmax(-1))
        scores = logits.softmax(-1).transpose(1, 2)  # [G, E, n]
        top = scores.topk(self.tokens_per_expert(n), -1)  # each expert's tokens
        token = (top.indices + n * torch.arange(g, device=x.device).view(g, 1, 1)).flatten()
        expert = torch.arange(experts, device=x.device).view(1, experts, 1).expand_as(top.indices).flatten()
        return self._routing(token, expert, top.values.flatten(), g * n)

    def _decide_capped(self, scores: torch.Tensor) -> Routing:
        """The capped form's routing from scores [G, n, E]: picks from the detached scores, gates S."""
        g, n, _ = scores.shape
        group, expert, column = self._capped(scores.detach(), self.tokens_per_expert(n)).nonzero(as_tuple=True)
        return self._routing(column + n * group, expert, scores[group, column, expert], g * n)

    def _routing(self, token: torch.Tensor, expert: torch.Tensor, gate: torch.Tensor, tokens: int) -> Routing:
        """The ``Routing`` of the experts' picks (flattened token ids, expert ids, gates) of ``tokens`` tokens."""
        picked = torch.zeros(tokens, device=token.device).index_fill_(0, token, 1.0)
        stats = {"tokens_per_expert": torch.bincount(expert, minlength=self.cfg.experts).float(),
                 "dropped": (tokens - picked.sum()), "assignments": torch.tensor(float(tokens))}
        return Routing(token, expert, gate, {}, stats)

    def _capped(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """[G, e, n] picks of the capped form (module ``ec_dykstra``), from the detached scores."""
        cfg = self.cfg
        assignment = dykstra_assignment(scores, k, cfg.max_experts_per_token, cfg.ec_entropy, cfg.ec_iterations)
        return capped_choice(assignment, k, cfg.max_experts_per_token)


class HierarchicalRouter(Router):
    """Shazeer et al. 2017's two-level (hierarchical) MoE (seed 001 line 141): the E experts form a equal groups of
    m = E/a. A group gate ``group_weight`` [a, d] picks each token's ``group_top_k`` groups, with gates
    softmax(KeepTopK(x W_group)); inside each chosen group i, that group's rows of ``weight`` (its own gate)
    pick ``top_k`` of its m experts, with gates softmax(KeepTopK(x W_i)). Expert (i, j) is weighted by the
    product G_group(x)_i · G_i(x)_j, so a token's gates sum to one. Only the chosen groups' gates matter, which is
    where the hierarchy saves work at large E. Dropless; the balancing loss is the paper's importance loss
    (w·CV² of the summed gates) at both levels. No gating noise (the paper's noisy gates are ``noisy_topk``'s)."""

    def __init__(self, cfg: MoEConfig, d_model: int):
        super().__init__(cfg, d_model)
        self.group_weight = nn.Parameter(torch.empty(cfg.expert_groups, d_model))

    def decide(self, x: torch.Tensor, logits: torch.Tensor, noise: SequenceNoise) -> Routing:
        g, n, experts = logits.shape
        groups, chosen_groups, k = self.cfg.expert_groups, self.cfg.group_top_k, self.cfg.k
        size = experts // groups
        first = self.logits(x, self.group_weight).topk(chosen_groups, -1)  # [G, n, ga]
        group_gate = first.values.softmax(-1)
        inside = logits.view(g, n, groups, size).gather(2, first.indices.unsqueeze(-1).expand(-1, -1, -1, size))
        second = inside.topk(k, -1)  # [G, n, ga, k]
        choices = (first.indices.unsqueeze(-1) * size + second.indices).reshape(g, n, chosen_groups * k)
        gates = (group_gate.unsqueeze(-1) * second.values.softmax(-1)).reshape(g, n, chosen_groups * k)
        losses = {}
        if self.cfg.aux_loss_weight > 0:
            w = self.cfg.aux_loss_weight
            dense_groups = torch.zeros(g, n, groups, device=x.device).scatter(-1, first.indices, group_gate)
            dense = torch.zeros_like(logits).scatter(-1, choices, gates)
            losses["importance"] = w * (cv_squared(dense_groups.sum(1)) + cv_squared(dense.sum(1))).mean()
        return self.token_choice(choices, gates, torch.ones_like(choices, dtype=torch.bool), None, losses)


ROUTER_CLASSES: dict[str, type[Router]] = {
    "topk": TopKRouter, "noisy_topk": NoisyTopKRouter, "gshard": GShardRouter, "switch": SwitchRouter,
    "expert_choice": ExpertChoiceRouter, "hierarchical": HierarchicalRouter, "sigmoid": SigmoidRouter,
}


# -- the layer -------------------------------------------------------------------------------------------------

class AuxLossGrad(torch.autograd.Function):
    """Returns ``out`` unchanged; its backward also starts the auxiliary loss's backward with gradient
    ``scale`` (the main loss's scale: loss scaler / microbatches), so the auxiliary losses train the router
    wherever the layer sits (a pipeline stage has no loss of its own to add them to)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        # aux's shape, not aux: nothing saved, so a recompute that forms no pooled balance loss saves as much
        ctx.aux, ctx.scale = (aux.shape, aux.dtype, aux.device), scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


@dataclass
class StepContext:
    """What the trainer tells each MoE layer at the start of a step (``begin_step``)."""

    seed: int = 0
    first_sequence: int = 0  # data-stream position of this rank's first sequence this step
    aux_scale: float = 1.0  # gradient scale of the auxiliary losses (as the main loss's)
    forwards: int = 0  # microbatches forwarded so far this step (not counting recomputes)
    offset: int = 0  # stream position of the current microbatch's first sequence


class MoELayer(nn.Module):
    """The MoE feed-forward: router → dispatcher(experts) → plus shared experts. [B, S, d] → [B, S, d]."""

    def __init__(self, cfg: ModelConfig, layer: int, swiglu: bool):
        super().__init__()
        moe = cfg.moe
        hidden = moe.d_expert or cfg.ffn_dim
        self.cfg, self.layer = moe, layer
        self.router = ROUTER_CLASSES[moe.router](moe, cfg.d_model)
        self.experts = Experts(moe.experts, cfg.d_model, hidden, swiglu, moe.expert_dropout)
        self.shared = SharedExperts(moe.shared_experts, cfg.d_model, hidden, swiglu, 0.0) if moe.shared_experts \
            else None
        self.dispatcher = LocalDispatcher()
        self.pool: BalancePool | None = None  # shared with the model's other MoE layers (``share_balance_pool``)
        self.context = StepContext()
        self.tally: dict[str, torch.Tensor] = {}
        # set by the pipeline stage holding this layer (``workers.parallel.pipeline``): the schedule's microbatch
        # index while it runs one of its chunks, None otherwise (its shape probe before the first step)
        self.pipelined, self.microbatch = False, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        groups = b if self.cfg.group == "sequence" else 1
        counted = self._locate(b)
        noise = SequenceNoise(self.context.seed, self.layer, self.context.offset, b, s)
        routing = self.router(flat.view(groups, -1, d), noise)
        if self.experts.dropout > 0 and self.training:
            routing.token_keys = noise.token_keys(x.device)
        out = self.dispatcher(flat, routing, self.experts)
        if routing.pooled is not None and self.pool is not None and not _in_backward():
            pooled = self.pool.add(self.layer, *routing.pooled)
            if pooled is not None:
                routing.losses["balance"] = pooled
        if self.shared is not None:
            out = out + self.shared(flat)
        if routing.losses and torch.is_grad_enabled():
            out = AuxLossGrad.apply(out, sum(routing.losses.values()), self.context.aux_scale)
        if counted:
            self._count(routing)
        return out.view(b, s, d)

    def _locate(self, b: int) -> bool:
        """Set the stream position of this forward's first sequence (its routing noise and dropout keys are drawn
        from it); True when the forward is one of the step's microbatches, to be tallied.

        Outside a pipeline, forwards come in microbatch order and a forward during a backward recomputes the one
        being backpropagated, the last counted. A pipeline stage runs several forwards before their backwards and
        probes its shapes once before the first step, so there the schedule's own microbatch index decides: a
        recompute takes its chunk's index, and the probe (no index) is neither placed nor tallied."""
        if self.pipelined:
            self.context.offset = self.context.first_sequence + (self.microbatch or 0) * b
            return self.microbatch is not None and not _in_backward()
        if _in_backward():
            return False
        self.context.offset = self.context.first_sequence + self.context.forwards * b
        self.context.forwards += 1
        return True

    @torch.no_grad()
    def _count(self, routing: Routing) -> None:
        """Add this microbatch's figures to the step's tally (losses as sums, averaged in ``step_figures``)."""
        figures = {**routing.stats, **{f"loss_{k}": v.detach().float() for k, v in routing.losses.items()},
                   "microbatches": torch.ones(())}
        for name, value in figures.items():
            value = value.detach().float().cpu()
            self.tally[name] = self.tally[name] + value if name in self.tally else value


def _in_backward() -> bool:
    """True while autograd runs a backward (so a forward now is activation recompute, not a new microbatch)."""
    return torch._C._current_graph_task_id() != -1


# -- what the trainer calls ----------------------------------------------------------------------------------

def moe_layers(modules: list[nn.Module]) -> dict[str, MoELayer]:
    """The MoE layers of this rank's model parts, by their name in the unsplit model (global layer index)."""
    out = {}
    for module in modules:
        for name, sub in module.named_modules():
            if isinstance(sub, MoELayer):
                out[plain_name(name.removeprefix("module."))] = sub  # DDP's hop, then the wrappers'
    return out


def pipeline_layers(stage_module: nn.Module) -> list[MoELayer]:
    """A pipeline stage's MoE layers, marked as placed by the schedule's microbatch index from now on (its shape
    probe included, which runs before any chunk)."""
    layers = list(moe_layers([stage_module]).values())
    for layer in layers:
        layer.pipelined = True
    return layers


@contextlib.contextmanager
def running_microbatch(layers: list[MoELayer], index: int):
    """Tell a pipeline stage's MoE layers which microbatch of the step the block runs (see ``MoELayer._locate``)."""
    for layer in layers:
        layer.microbatch = index
    try:
        yield
    finally:
        for layer in layers:
            layer.microbatch = None


def begin_step(modules: list[nn.Module], seed: int, first_sequence: int, aux_scale: float) -> None:
    """Tell every MoE layer where this step's sequences start in the data stream and the loss scale."""
    for layer in moe_layers(modules).values():
        layer.context = StepContext(seed=seed, first_sequence=first_sequence, aux_scale=aux_scale)
        layer.tally = {}


TALLY = ("tokens_per_expert", "dropped", "assignments", "microbatches")


def end_step(modules: list[nn.Module], dp_group: dist.ProcessGroup | None) -> dict[str, dict]:
    """Sum each layer's step tally over the data-parallel ranks (one all-reduce), move the balancing biases,
    and return the step's figures per MoE layer (``step_figures``). Empty for a dense model."""
    layers = moe_layers(modules)
    if not layers:
        return {}
    names = sorted(layers)
    flat = torch.cat([_tally_vector(layers[name]) for name in names])
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        device = layers[names[0]].router.weight.device
        flat = flat.to(device)
        dist.all_reduce(flat, group=dp_group)
        flat = flat.cpu()
    out, at = {}, 0
    for name in names:
        layer = layers[name]
        size = _tally_vector(layer).numel()
        summed = _unpack(layer, flat[at:at + size])
        at += size
        if isinstance(layer.router, TopKRouter):
            layer.router.update_bias(summed["tokens_per_expert"].to(layer.router.bias.device))
        out[name] = step_figures(summed)
    return out


def _tally_vector(layer: MoELayer) -> torch.Tensor:
    """The layer's tally as one vector (fixed keys first, then its losses sorted by name)."""
    e = layer.cfg.experts
    fixed = [layer.tally.get("tokens_per_expert", torch.zeros(e))]
    fixed += [layer.tally.get(k, torch.zeros(())).reshape(1) for k in TALLY[1:]]
    losses = [layer.tally[k].reshape(1) for k in sorted(layer.tally) if k.startswith("loss_")]
    return torch.cat(fixed + losses)


def _unpack(layer: MoELayer, vector: torch.Tensor) -> dict[str, torch.Tensor]:
    e = layer.cfg.experts
    out = {"tokens_per_expert": vector[:e]}
    for i, key in enumerate(TALLY[1:]):
        out[key] = vector[e + i]
    for i, key in enumerate(k for k in sorted(layer.tally) if k.startswith("loss_")):
        out[key] = vector[e + len(TALLY) - 1 + i]
    return out


def step_figures(summed: dict[str, torch.Tensor]) -> dict:
    """Tokens per expert (summed over the step's microbatches and dp ranks), the drop fraction (dropped over
    wanted assignments; expert choice: tokens no expert picked over tokens), each auxiliary loss (mean over
    microbatches and ranks) and the balance figure max/mean load (1.0 is perfect balance)."""
    load = summed["tokens_per_expert"]
    mean = float(load.mean())
    figures = {
        "tokens_per_expert": [int(v) for v in load.tolist()],
        "drop_fraction": float(summed["dropped"] / summed["assignments"]) if summed["assignments"] > 0 else 0.0,
        "balance": float(load.max()) / mean if mean > 0 else 0.0,
    }
    count = float(summed["microbatches"]) or 1.0
    for key, value in summed.items():
        if key.startswith("loss_"):
            figures[f"aux_{key[5:]}"] = float(value) / count
    return figures


# -- initial values (asked first by the families' init_parameter hook) ------------------------------------------------

SWITCH_INIT_SCALE = 0.1  # Switch Transformer's s in σ = sqrt(s / fan_in)


def moe_parameter(name: str, shape: tuple, generator: torch.Generator, cfg: ModelConfig) -> torch.Tensor | None:
    """An MoE layer's parameter's full initial value, or None for any other parameter (the GPT's rule draws it:
    ``workers.model.gpt.init_parameter``, the families' hook, asks here first).

    Stacked expert weights are drawn whole ([E, ...] from the one generator of their name), so an expert's
    values do not depend on how experts are split over ranks. Noisy top-k's two gating matrices start at
    zero (the paper's choice); under ``router: switch`` router and expert weights are drawn from a normal
    truncated at two standard deviations with σ = sqrt(0.1 / fan_in) (the paper's smaller init). Otherwise
    routers and experts follow the GPT's normal(0, init_std), output projections scaled by depth.
    """
    kind = _moe_kind(name)
    if kind is None or cfg.moe is None:
        return None
    if cfg.moe.router == "noisy_topk" and kind == "router":
        return torch.zeros(shape)
    if cfg.moe.router == "switch":
        std = math.sqrt(SWITCH_INIT_SCALE / shape[-2 if kind != "router" else -1])
        return nn.init.trunc_normal_(torch.empty(shape), 0.0, std, -2 * std, 2 * std, generator=generator)
    std = cfg.init_std / (math.sqrt(2 * cfg.n_layers) if name.endswith(".w2") else 1.0)
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def _moe_kind(name: str) -> str | None:
    """``router`` or ``experts`` for a parameter of an MoE layer (by its name), else None."""
    parts = name.split(".")
    if "router" in parts:
        return "router"
    if "experts" in parts or "shared" in parts:
        return "experts"
    return None
