"""Mixture of experts against the model and the layout: an MoE section that places no MoE layer, and
`parallel.ep`. The checks within `model.moe` are `MoESpec`'s (orchestrator/spec/moe.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from orchestrator.spec.fields import _divisors

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


def check_moe(job: JobSpec) -> None:
    """An MoE section that places no MoE layer."""
    moe, model = job.model.moe, job.model
    if moe is None:
        return
    check_shared_split(job)
    if moe.every > model.n_layers:
        raise SpecError("model.moe.every", moe.every, f"is more than model.n_layers={model.n_layers}, so no block "
                        "would get an MoE feed-forward", f"set model.moe.every to at most {model.n_layers} "
                        "(1: every block, 2: every other block)")
    if moe.balance_loss == "pooled" and moe.aux_loss_weight > 0 and job.parallel.pp > 1:
        raise SpecError("model.moe.balance_loss", "pooled", f"averages the routing of every MoE layer before one "
                        f"product, and parallel.pp={job.parallel.pp} puts the layers in different stages",
                        "set model.moe.balance_loss: per_layer (or aux_loss_weight: 0) under pipeline parallelism")


def check_shared_split(job: JobSpec) -> None:
    """DeepSeek-V3's tensor-parallel plan splits the shared experts' hidden units over tp like a dense SwiGLU
    (``workers.parallel.deepseek_parallel``), so tp must divide their width (the heads and d_ff are
    ``check_tensor_split``'s)."""
    moe, model, tp = job.model.moe, job.model, job.parallel.tp
    hidden = moe.d_expert or model.ffn_dim
    if model.arch != "deepseek_v3" or not moe.shared_experts or hidden % tp == 0:
        return
    raise SpecError("model.moe.d_expert", hidden, f"(the shared experts' hidden width) is not divisible by "
                    f"parallel.tp={tp}, and deepseek_v3's tensor-parallel plan gives each tp rank an equal slice of it",
                    f"set model.moe.d_expert to a multiple of {tp}, or pick parallel.tp dividing {hidden}")


def check_expert_parallel(job: JobSpec) -> None:
    """``parallel.ep`` needs MoE layers whose experts it divides, and a data-parallel mode that reduces the
    experts over the ranks holding them (``workers.parallel.expert_parallel``); ``ep`` dividing dp is the
    parallel section's own check."""
    p, moe = job.parallel, getattr(job.model, "moe", None)
    check_expert_tp(job)
    if p.ep == 1:
        return
    if moe is None:
        raise SpecError("parallel.ep", p.ep, "splits the experts of MoE layers, and model.moe is not set",
                        "set parallel.ep: 1, or give the model MoE layers (model.moe: {experts: 8})")
    if moe.experts % p.ep:
        raise SpecError("parallel.ep", p.ep, f"does not divide model.moe.experts={moe.experts}: every ep rank "
                        "holds the same number of experts",
                        f"pick ep from {', '.join(map(str, _divisors(moe.experts)))} (dividing dp too), "
                        "or change the expert count")
    refused = [  # (field, value, applies, problem, fix)
        ("optim.name", job.optim.name, job.optim.name == "onebit_adam", "with parallel.ep > 1 is not supported: "
         "1-bit Adam averages every parameter's momentum over all dp ranks, which hold different experts",
         "use optim.name: adamw, or parallel.ep: 1"),
        ("parallel.dp_sync", p.dp_sync, p.dp_sync == "ps", "with parallel.ep > 1 is not supported: parameter-"
         "server shards key one copy of each parameter, and ep ranks hold different experts",
         "use dp_sync: allreduce"),
    ]
    for field, value, applies, problem, fix in refused:
        if applies:
            raise SpecError(field, value, problem, fix)


def check_expert_tp(job: JobSpec) -> None:
    """``parallel.expert_tp`` splits each routed expert's hidden over the tp group, inside the expert-parallel
    dispatch (``workers.parallel.expert_parallel``): it needs tp > 1, ep > 1 and a hidden width tp divides."""
    p, model = job.parallel, job.model
    if not p.expert_tp:
        return
    moe = getattr(model, "moe", None)
    hidden = (moe.d_expert or model.ffn_dim) if moe is not None else None
    refused = [  # (field, value, applies, problem, fix)
        ("parallel.tp", p.tp, p.tp == 1, "is 1, and parallel.expert_tp splits each expert over the tp group",
         "set parallel.tp > 1, or remove parallel.expert_tp"),
        ("parallel.ep", p.ep, p.ep == 1, "is 1, and parallel.expert_tp runs inside the expert-parallel dispatch",
         "set parallel.ep > 1 (a divisor of dp and of model.moe.experts), or remove parallel.expert_tp"),
        ("model.moe.d_expert", hidden, hidden is not None and hidden % p.tp != 0, f"(the experts' hidden width) is "
         f"not divisible by parallel.tp={p.tp}, and parallel.expert_tp gives each tp rank an equal slice of it",
         f"set model.moe.d_expert to a multiple of {p.tp}, or remove parallel.expert_tp"),
    ]
    for field, value, applies, problem, fix in refused:
        if applies:
            raise SpecError(field, value, problem, fix)
