"""What `parallel.dp_sync: ps` cannot combine with, `parameter_server:` settings without shards, `kill_ps_shard`
faults and the scheduled shard resizes (`parameter_server.resize`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, get_args

from orchestrator.errors import SpecError
from orchestrator.spec.fields import changed
from workers.contract.sections import ParameterServerSection

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


def check_parameter_server(job: JobSpec) -> None:
    """What `dp_sync: ps` cannot combine with, and `kill_ps_shard` faults."""
    p, ps = job.parallel, job.parameter_server
    kills = [i for i, f in enumerate(job.faults) if f.kind == "kill_ps_shard"]
    if p.dp_sync != "ps":
        if kills:
            raise SpecError(f"faults.{kills[0]}.kind", "kill_ps_shard", "needs parameter-server shards",
                            "set parallel.dp_sync: ps, or remove the fault")
        if ps.tls_cert is not None:  # refused, not ignored: the job file would promise an encrypted wire
            raise SpecError("parameter_server.tls_cert", ps.tls_cert, "needs parameter-server shards (this job "
                            f"has parallel.dp_sync: {p.dp_sync}, so there is no shard wire to encrypt)",
                            "set parallel.dp_sync: ps, or remove parameter_server.tls_cert and tls_key")
        _refuse_ps_settings_without_shards(job)
        return
    unsupported = [
        ("parallel.zero", p.zero, p.zero > 0, "the shards already hold the only optimizer state",
         "set parallel.zero: 0"),
        ("parameter_server.consistency", ps.consistency, ps.consistency != "bsp" and p.grid.tp_enabled,
         f"with parallel.tp={p.tp}: a free-running replica's tensor-parallel ranks would each push its replicated "
         "weights and tick its clock, applying them tp times", "use consistency: bsp with tensor parallelism, or "
         "parallel.tp: 1 (asp/ssp work with pipeline parallelism)"),
    ]
    for field, value, bad, why, fix in unsupported:
        if bad:
            raise SpecError(field, value, f"is not supported with parallel.dp_sync: ps ({why})", fix)
    shard_optimizers = get_args(get_args(ParameterServerSection.model_fields["optimizer"].annotation)[0])
    if ps.optimizer is None and job.optim.name not in shard_optimizers:
        raise SpecError("optim.name", job.optim.name, "has no parameter-server version (parameter_server.optimizer "
                        f"is unset, so the shards would run optim.name; they run {', '.join(shard_optimizers)})",
                        "set parameter_server.optimizer to one of those, or use parallel.dp_sync: allreduce")
    if ps.optimizer == "momentum" and job.optim.momentum == 0:
        raise SpecError("parameter_server.optimizer", "momentum", "needs optim.momentum > 0",
                        "set optim.momentum (e.g. 0.9), or optimizer: sgd")
    if changed(ps, "staleness") and ps.consistency != "ssp":
        raise SpecError("parameter_server.staleness", ps.staleness, "is only read by consistency: ssp (bsp waits for "
                        f"every replica, asp for none), not {ps.consistency!r}",
                        "set parameter_server.consistency: ssp, or remove staleness")
    if changed(ps, "topk_ratio") and ps.compression != "topk":
        raise SpecError("parameter_server.topk_ratio", ps.topk_ratio, "is only read by compression: topk, not "
                        f"{ps.compression!r}", "set parameter_server.compression: topk, or remove topk_ratio")
    for i, f in enumerate(job.faults):
        if f.kind in ("kill_node", "hang_rank", "nan_loss", "raise_error", "oom"):
            raise SpecError(f"faults.{i}.kind", f.kind, "is not recoverable with parallel.dp_sync: ps (only a "
                            "killed rank is: kill_rank)", "use kill_rank, slow_rank or kill_ps_shard")
        shards = ps.shards_at(f.at_step or 1)  # the count in force at the fault's step (parameter_server.resize)
        if f.kind == "kill_ps_shard" and (shards < 2 or f.shard >= shards):
            raise SpecError(f"faults.{i}.shard", f.shard, f"is not a shard that can die and be taken over "
                            f"({shards} shards at step {f.at_step}; a replica needs at least 2)",
                            f"pick a shard from 0 to {shards - 1} with shards >= 2 at that step")


def _refuse_ps_settings_without_shards(job: JobSpec) -> None:
    """A `parameter_server:` setting in a job without shards is refused, not ignored: `consistency: asp` would
    promise asynchronous training that the all-reduce never does (`resize` has its own check)."""
    ps = job.parameter_server
    given = [f for f in ParameterServerSection.model_fields if f != "resize" and changed(ps, f)]
    if given:
        raise SpecError(f"parameter_server.{given[0]}", getattr(ps, given[0]), "is only read by parameter-server "
                        f"shards, and this job has parallel.dp_sync: {job.parallel.dp_sync}",
                        "set parallel.dp_sync: ps to train through the shards, or remove the parameter_server section")


def check_ps_resize(job: JobSpec) -> None:
    """Each resize needs the shards, falls inside the run, comes after the one before it and changes the count."""
    ps = job.parameter_server
    if ps.resize and job.parallel.dp_sync != "ps":
        raise SpecError("parameter_server.resize", [r.model_dump() for r in ps.resize],
                        "needs parameter-server shards", "set parallel.dp_sync: ps, or remove parameter_server.resize")
    before, last_step = ps.shards, 1
    for i, r in enumerate(ps.resize):
        if not last_step < r.at_step <= job.train.steps:
            raise SpecError(f"parameter_server.resize[{i}].at_step", r.at_step,
                            f"must lie after the previous resize's step ({last_step}) and within train.steps "
                            f"({job.train.steps}): the chunks move between two steps of the run",
                            f"pick a step from {last_step + 1} to {job.train.steps}, in increasing order")
        if r.shards == before:
            raise SpecError(f"parameter_server.resize[{i}].shards", r.shards,
                            f"is already the shard count before step {r.at_step}, so nothing would move",
                            f"pick another count than {before}, or remove this resize")
        before, last_step = r.shards, r.at_step
