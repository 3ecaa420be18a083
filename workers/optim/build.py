"""Optimizers, learning-rate schedules and global gradient clipping."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from parameter_server.optimizers import decay_for
from workers.contract.sections import OffloadSection, OptimSection
from workers.offload.optimizer import OffloadedAdam
from workers.offload.paged import StatePager, device_probe
from workers.offload.store import OffloadStore
from workers.optim.adafactor import ShardedAdafactor
from workers.optim.implementations import kernel_kwargs
from workers.optim.muon import Hybrid, muon_optimizer, muon_owns
from workers.optim.onebit_adam import OneBitAdam
from workers.optim.sm3 import SM3

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
              "adafactor": torch.optim.Adafactor, "sm3": SM3}


def build_optimizer(params, optim: OptimSection, offload: OffloadSection | None = None,
                    device: torch.device | str = "cpu", shards=None, dp_group=None,
                    names: list[str] | None = None) -> torch.optim.Optimizer:
    """The job's optimizer over ``params`` (under ZeRO-1, this rank's slices: ``DistributedOptimizer.shards``).
    ``onebit_adam`` averages its compressed momentum over ``dp_group`` (None: one data-parallel rank).
    ``muon`` needs the parameters' global ``names`` (which ones Muon steps: ``workers.optim.muon.muon_owns``);
    ``onebit_adam`` keys each parameter's error feedback by them.

    ``paged_adamw``, or adam/adamw with ``offload.optimizer`` (the job's ``memory.offload``), keeps its state in an
    offload store (without ``offload``: the section's defaults, a host store); with ``offload.page_at`` the state
    stays on the device and moves to the store only under memory pressure (``_paged``; paged_adamw is AdamW there)
    (and steps the stored shards of ``shards``, a ``ParamOffload``, when parameters are offloaded too).
    ``optim.implementation`` picks PyTorch's fused, foreach or per-parameter kernels
    (``workers.optim.implementations``; the spec refuses it for optimizers that have no choice).
    ``optim.state_dtype: bf16`` steps adam/adamw with bfloat16 moments (``workers.optim.state_dtype``).
    Every path takes ``decay_groups``: the parameters ``optim.weight_decay_exclude`` spares in a group of their own.
    """
    name = optim.name
    if name == "muon":
        return _muon_hybrid(list(zip(names, params, strict=True)), optim, dp_group)
    params = list(params)
    named = {id(p): n for n, p in zip(names, params, strict=True)} if names is not None else None
    params = decay_groups(params, optim)
    kwargs = {"lr": optim.lr, "weight_decay": optim.weight_decay}
    if name in ("sgd", "sm3"):
        kwargs["momentum"] = optim.momentum
    elif name != "adafactor":
        kwargs["betas"] = tuple(optim.betas)
    stored = offload is not None and offload.optimizer and name in ("adam", "adamw")
    paged = offload is not None and offload.page_at is not None
    if paged and name == "paged_adamw":  # on the device, paged by pressure (_paged) rather than always stored
        name = "adamw"
    if (name == "paged_adamw" or stored) and not paged:
        store = OffloadStore.from_spec(offload or OffloadSection(), device)
        return OffloadedAdam(params, store, decoupled_weight_decay=name != "adam", shards=shards, **kwargs)
    if name == "onebit_adam":
        return OneBitAdam(params, dp_group, optim.warmup_steps, names=named, **kwargs)
    if optim.state_dtype != "fp32" and name in ("adam", "adamw"):
        return _low_precision_adam(params, optim, decoupled=name == "adamw", **kwargs)
    tensors = [p for group in params for p in group["params"]]
    on_cuda = any(p.is_cuda for p in tensors)  # a DTensor is where its local shard is
    mixed = len({isinstance(p, DTensor) for p in tensors}) > 1
    kwargs.update(kernel_kwargs(name, optim.implementation, on_cuda, mixed))
    sharded = name == "adafactor" and any(isinstance(p, DTensor) for p in tensors)
    # whole-matrix statistics over the shards (optim/adafactor.py)
    opt = (ShardedAdafactor if sharded else OPTIMIZERS[name])(params, **kwargs)
    return _paged(opt, offload, device) if paged else opt


def _paged(opt: torch.optim.Optimizer, offload: OffloadSection, device) -> torch.optim.Optimizer:
    """``opt`` with a ``StatePager`` attached: its state goes to the store only under memory pressure
    (``memory.offload.page_at``, workers/offload/paged.py)."""
    StatePager(opt, OffloadStore.from_spec(offload, device), offload.page_at, device_probe(device))
    return opt


def _low_precision_adam(params: list[dict], optim: OptimSection, decoupled: bool, **kwargs) -> torch.optim.Optimizer:
    """Adam/AdamW with their moments in ``optim.state_dtype`` (``workers.optim.state_dtype``), imported here: it
    loads torchao, which jobs on float32 state never need."""
    from workers.optim.state_dtype import STATE_DTYPES, LowPrecisionAdam

    return LowPrecisionAdam(params, decoupled_weight_decay=decoupled, state_dtype=STATE_DTYPES[optim.state_dtype],
                            **kwargs)


def _muon_hybrid(named: list[tuple[str, torch.Tensor]], optim: OptimSection, dp_group=None) -> Hybrid:
    """Muon over the blocks' matrices and, over the rest, the optimizer an ``adamw`` job builds (``decay_groups``,
    ``optim.betas``, PyTorch's kernels as ``auto`` picks them: the spec refuses ``optim.implementation`` and
    optimizer offload with muon), as one optimizer; a part without one kind (a stage of norms and matrices only
    still has norms) builds only the other. ``dp_group``: the ranks ZeRO-0's plain gradients are replicated over,
    which split the Newton-Schulz work (``WholeMatrixMuon``)."""
    matrices = [p for n, p in named if muon_owns(n, p)]
    rest = [p for n, p in named if not muon_owns(n, p)]
    parts = [muon_optimizer(matrices, optim, dp_group)] if matrices else []
    if rest:
        parts.append(build_optimizer(rest, optim.model_copy(update={"name": "adamw"})))
    return Hybrid(parts)


def decay_groups(params, optim: OptimSection) -> list[dict]:
    """``params`` as optimizer param groups by weight decay (``parameter_server.optimizers.decay_for``, by each
    tensor's dimensions: a ZeRO-1 slice and an FSDP2 shard are DTensors of their parameter's global shape, so they
    keep its group). One group where all decay alike (the default ``weight_decay: 0``), as before the rule."""
    groups: dict[float, list] = {}
    for p in params:
        groups.setdefault(decay_for(optim.weight_decay, optim.weight_decay_exclude, p.dim()), []).append(p)
    return [{"params": members, "weight_decay": decay} for decay, members in groups.items()]


# a decay's curve: the share of (1 - min_lr_ratio) left at progress p in [0, 1]
DECAY_SHAPES = {"cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)), "linear": lambda p: 1 - p,
                "1-sqrt": lambda p: 1 - math.sqrt(p)}


def lr_lambda(optim: OptimSection, total_steps: int):
    """The factor of ``optim.lr`` at each step (0-based): linear warmup over ``warmup_steps``, then ``schedule``:
    constant, or a decay to ``min_lr_ratio`` at ``total_steps`` (cosine, linear; wsd holds 1 until its decay
    window, ``decay_window``, then decays in ``decay_shape``).

    Computed from the step alone, with ``total_steps`` the job's ``train.steps``: a ``--resume`` continues the
    saved position exactly, and one with a longer ``train.steps`` stretches the decay to the new end from there.
    """
    warmup, floor, schedule = optim.warmup_steps, optim.min_lr_ratio, optim.schedule
    start, length = decay_window(optim, total_steps)
    shape = DECAY_SHAPES.get(optim.decay_shape if schedule == "wsd" else schedule)  # None: constant

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if shape is None:
            return 1.0
        progress = min(1.0, max(0.0, (step - start) / length))
        return floor + (1 - floor) * shape(progress)

    return factor


def decay_window(optim: OptimSection, total_steps: int) -> tuple[int, int]:
    """``(first step, length)`` of the decay: every step after warm-up for cosine and linear; wsd's last
    ``decay_steps`` (else ``decay_ratio`` of ``total_steps``), cut to the steps after warm-up rather than refused,
    as a smoke run of a long job (``--set train.steps=3``) must still start (torchtitan cuts it the same way)."""
    warmup = optim.warmup_steps
    after = max(1, total_steps - warmup)
    if optim.schedule != "wsd":
        return warmup, after
    wanted = optim.decay_steps or max(1, round(optim.decay_ratio * total_steps))
    length = min(wanted, after)
    return total_steps - length, length


def global_grad_norm(params: list[torch.nn.Parameter], pp_group=None, experts: tuple = ()) -> torch.Tensor:
    """L2 norm of all gradients of the job.

    Sums of squares of sharded DTensor gradients are added up per (mesh, sharded
    dims) and all-reduced once per group, not once per parameter; replicated
    gradients count once; pipeline stages are summed over ``pp_group``. Every
    placement but Replicate counts as sharded: FSDP2 on top of TP shards with
    ``_StridedShard``, whose ``is_shard()`` is False on torch 2.13. ``experts``
    is ``(expert parameters, ep group)`` under expert parallelism: the ep ranks
    hold different experts, so those squares are summed over the ep group too.
    """
    device = params[0].device  # NCCL reduces device tensors only
    expert_params, ep_group = experts or ((), None)
    ids = {id(p) for p in expert_params}
    total = _squares([p for p in params if id(p) not in ids], device)
    if ids:
        held = _squares([p for p in params if id(p) in ids], device)
        dist.all_reduce(held, group=ep_group)
        total = total + held
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def _squares(params: list[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    """Sum of squares of ``params``' gradients over the ranks that shard them (see ``global_grad_norm``)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    sharded: dict[tuple, torch.Tensor] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            total = total + g.full_tensor().float().pow(2).sum()
        elif isinstance(g, DTensor):
            key = (g.device_mesh, tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate()))
            sharded[key] = sharded.get(key, 0) + g.to_local().float().pow(2).sum()
        else:
            total = total + g.float().pow(2).sum()
    for (mesh, dims), squares in sharded.items():
        for dim in dims:
            dist.all_reduce(squares, group=mesh.get_group(dim))
        total = total + squares
    return total


def clip_grads(params: list[torch.nn.Parameter], max_norm: float, pp_group=None, experts: tuple = ()) -> float:
    """Scale all gradients so their global norm is at most ``max_norm`` (0 disables).

    A per-tensor loop with a Python float rather than ``clip_grads_with_norm_``:
    TP without sequence parallelism mixes DTensor and plain gradients, which
    PyTorch's foreach kernels refuse.
    """
    return clip_to_norm(params, max_norm, float(global_grad_norm(params, pp_group, experts)))


def clip_to_norm(params: list[torch.nn.Parameter], max_norm: float, norm: float) -> float:
    """Scale ``params``' gradients, whose global norm is ``norm``, to at most ``max_norm`` (0 disables); returns
    ``norm``. Apart from ``clip_grads`` for an engine that counts the norm itself (a replicated stage once)."""
    coef = max_norm / (norm + 1e-6)
    if max_norm > 0 and coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
