"""Checks that span sections (layout vs model shape, batching vs schedule, what combines with what).

Each takes the whole `JobSpec` and raises a `SpecError` naming the field, the value and the fix; `JobSpec` runs
them all, in `CROSS_FIELD_CHECKS` order, after every section validated on its own."""

from __future__ import annotations

from functools import reduce
from typing import TYPE_CHECKING, get_args

from orchestrator.errors import SpecError
from orchestrator.faults.soak import check_repetition
from orchestrator.spec.async_pipeline_checks import ASYNC, check_async_pipeline
from orchestrator.spec.context_checks import check_context_parallel
from orchestrator.spec.document_checks import check_document_mask
from orchestrator.spec.dpo_checks import check_dpo
from orchestrator.spec.eval_checks import check_eval
from orchestrator.spec.fields import _divisors, _near_multiples
from orchestrator.spec.lora import check_lora
from orchestrator.spec.loss_chunk_checks import check_loss_chunks
from orchestrator.spec.moe import check_moe
from orchestrator.spec.ps_resize_checks import check_ps_resize
from orchestrator.spec.sections import ParameterServerSpec
from orchestrator.spec.throughput_checks import check_compile, check_fsdp_prefetch, check_optim_implementation
from workers.parallel.mixed_precision import fsdp_applies, planned_fsdp_mixed
from workers.parallel.partition import split_problem

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
    shard_optimizers = get_args(get_args(ParameterServerSpec.model_fields["optimizer"].annotation)[0])
    if ps.optimizer is None and job.optim.name not in shard_optimizers:
        raise SpecError("optim.name", job.optim.name, "has no parameter-server version (parameter_server.optimizer "
                        f"is unset, so the shards would run optim.name; they run {', '.join(shard_optimizers)})",
                        "set parameter_server.optimizer to one of those, or use parallel.dp_sync: allreduce")
    if ps.optimizer == "momentum" and job.optim.momentum == 0:
        raise SpecError("parameter_server.optimizer", "momentum", "needs optim.momentum > 0",
                        "set optim.momentum (e.g. 0.9), or optimizer: sgd")
    if _changed(ps, "staleness") and ps.consistency != "ssp":
        raise SpecError("parameter_server.staleness", ps.staleness, "is only read by consistency: ssp (bsp waits for "
                        f"every replica, asp for none), not {ps.consistency!r}",
                        "set parameter_server.consistency: ssp, or remove staleness")
    if _changed(ps, "topk_ratio") and ps.compression != "topk":
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
    given = [f for f in ParameterServerSpec.model_fields if f != "resize" and _changed(ps, f)]
    if given:
        raise SpecError(f"parameter_server.{given[0]}", getattr(ps, given[0]), "is only read by parameter-server "
                        f"shards, and this job has parallel.dp_sync: {job.parallel.dp_sync}",
                        "set parallel.dp_sync: ps to train through the shards, or remove the parameter_server section")


def check_offload(job: JobSpec) -> None:
    """Offload combinations that cannot work, refused with the fix (workers/offload/)."""
    off, name, p = job.memory.offload, job.optim.name, job.parallel
    if off.tier == "nvme" and not off.path:
        raise SpecError("memory.offload.path", off.path, "is required for tier nvme (where the files go)",
                        "set memory.offload.path to a directory on a local NVMe drive, or use tier: cpu")
    if off.path and off.tier != "nvme":
        raise SpecError("memory.offload.path", off.path, f"is only used by tier nvme, not {off.tier!r}",
                        "set memory.offload.tier: nvme, or remove memory.offload.path")
    if off.optimizer and name not in ("adamw", "adam", "paged_adamw"):
        raise SpecError("memory.offload.optimizer", True, f"is not supported for optim.name {name!r}: the "
                        "offloaded host step is Adam's", "use optim.name adamw, adam or paged_adamw, "
                        "or set memory.offload.optimizer: false")
    zero_slices = p.zero >= 2 or (p.zero == 1 and p.grid.dp_enabled)  # ZeRO-1 steps row slices too
    if name == "adafactor" and (zero_slices or p.grid.tp_enabled):
        field, value = ("parallel.zero", p.zero) if zero_slices else ("parallel.tp", p.tp)
        raise SpecError(field, value, "shards parameters, which optim.name 'adafactor' (PyTorch's) cannot step "
                        "exactly: its factored second moment divides row means by column means of whole "
                        "matrices, and a shard sees only some rows or columns",
                        "use optim.name sm3 (same O(rows + cols) state, steps shards exactly), adamw with "
                        "memory.offload.optimizer or paged_adamw, or zero: 0 with tp: 1 for adafactor")
    stored_optim = off.optimizer or name == "paged_adamw"
    if off.params:
        check_param_offload(job, stored_optim)


def check_param_offload(job: JobSpec, stored_optim: bool) -> None:
    """ZeRO-3 parameter offload (workers/offload/params.py) lives on FSDP2's units; what it does not cover."""
    p = job.parallel
    if p.zero != 3 or p.dp_sync == "ps":
        field, value = ("parallel.zero", p.zero) if p.zero != 3 else ("parallel.dp_sync", p.dp_sync)
        raise SpecError(field, value, "cannot be combined with memory.offload.params: only ZeRO-3 (FSDP2, "
                        "parameters sharded between uses) has per-unit shards to offload",
                        "set parallel.zero: 3 (with dp_sync: allreduce), or memory.offload.params: false")
    if not stored_optim:
        raise SpecError("memory.offload.params", True, "needs the optimizer step on the host: the offloaded "
                        "shards are updated where they are stored",
                        "also set memory.offload.optimizer: true (optim.name adamw or adam), or use "
                        "optim.name paged_adamw")


def check_muon(job: JobSpec) -> None:
    """Where ``optim.name: muon`` cannot orthogonalise whole matrices (workers/optim/muon.py), refused before start:
    ZeRO-1 steps flat slices of the parameters, the parameter-server shards flat chunks of them, and the offloaded
    host step is Adam's; and LoRA, where no parameter Muon would step trains (``muon_owns`` leaves adapters to
    AdamW), so the job would be AdamW under Muon's name."""
    p, off = job.parallel, job.memory.offload
    if job.optim.name != "muon":
        return
    refused = [  # (field, value, applies, why, fix)
        ("parallel.zero", p.zero, p.zero == 1 and p.dp * p.cp > 1, "steps each rank's flat slice of the "
         "parameters (workers/parallel/distributed_optimizer.py), and Muon's Newton-Schulz needs whole matrices",
         "use parallel.zero: 2 or 3 (FSDP2 shards, which Muon gathers per matrix) or 0"),
        ("parallel.dp_sync", p.dp_sync, p.dp_sync == "ps", "steps flat chunks of the parameters on the "
         "parameter-server shards, and Muon's Newton-Schulz needs whole matrices",
         "use parallel.dp_sync: allreduce with optim.name muon, or another optim.name"),
        ("memory.offload.optimizer", off.optimizer, off.optimizer, "runs an offloaded Adam step on the host, "
         "which Muon's matrices do not have", "set memory.offload.optimizer: false, or use optim.name adamw"),
        ("model.lora", "set", job.model.lora is not None, "freezes the blocks' matrices Muon steps and trains only "
         "the adapters, which get AdamW (each is a low-rank factor: orthogonalising A and B apart is not Muon's "
         "update of the product B·A, and the AdamW-matched rate is Moonlight's for whole matrices), so Muon would "
         "step nothing", "use optim.name: adamw with model.lora (the same update), or remove model.lora"),
    ]
    for field, value, applies, why, fix in refused:
        if applies:
            raise SpecError(field, value, f"is not supported with optim.name muon: it {why}", fix)


def check_faults(job: JobSpec) -> None:
    ft, world = job.fault_tolerance, job.parallel.world_size
    if ft.collective_timeout_s >= ft.heartbeat_timeout_s:
        raise SpecError(
            "fault_tolerance.collective_timeout_s", ft.collective_timeout_s,
            f"is not below fault_tolerance.heartbeat_timeout_s={ft.heartbeat_timeout_s}: survivors blocked on "
            "a hung rank must give up before the controller declares the hang",
            "set collective_timeout_s below heartbeat_timeout_s",
        )
    if ft.min_dp > job.parallel.dp:
        raise SpecError("fault_tolerance.min_dp", ft.min_dp, f"is above parallel.dp={job.parallel.dp}: the job "
                        "would start below its own floor", f"set min_dp to at most {job.parallel.dp}")
    for i, fault in enumerate(job.faults):
        if fault.rank != "random" and not (isinstance(fault.rank, int) and 0 <= fault.rank < world):
            raise SpecError(f"faults.{i}.rank", fault.rank, f"is not a rank of this {world}-rank job",
                            f"pick a rank from 0 to {world - 1}, or `random` with every_s")
        if fault.at_step is not None and fault.at_step > job.train.steps:
            raise SpecError(f"faults.{i}.at_step", fault.at_step, f"is after the last step {job.train.steps}",
                            f"pick a step from 1 to {job.train.steps}")
        check_repetition(fault, f"faults.{i}")
        _check_fault_options(fault, f"faults.{i}")


def _check_fault_options(fault, where: str) -> None:
    """``factor`` and ``shard`` mean something to one kind each; set on another, the user expects an effect that
    never comes (a slow kill, a shard picked for a rank's death). A default value is not flagged (``_changed``)."""
    for option, kind in (("factor", "slow_rank"), ("shard", "kill_ps_shard")):
        if _changed(fault, option) and fault.kind != kind:
            raise SpecError(f"{where}.{option}", getattr(fault, option), f"is read by kind {kind} only, and this "
                            f"fault is {fault.kind}", f"remove {where}.{option}, or set {where}.kind: {kind}")


def check_recompute(job: JobSpec) -> None:
    m = job.memory
    if m.recompute_every > 1 and m.recompute == "sqrt":
        raise SpecError("memory.recompute_every", m.recompute_every, "is chosen by memory.recompute: sqrt itself "
                        "(every round(sqrt(n_layers))-th block)", "remove memory.recompute_every, or set "
                        "memory.recompute: full to pick the interval yourself")
    if m.recompute_every > 1 and m.recompute == "none":
        raise SpecError("memory.recompute_every", m.recompute_every, "picks which blocks memory.recompute applies "
                        "to, and memory.recompute is 'none'", "set memory.recompute: full or selective, or "
                        "remove memory.recompute_every")


def check_zero(job: JobSpec) -> None:
    """Combinations PyTorch 2.13's own pieces get wrong; refused rather than trained silently wrong."""
    p = job.parallel
    refused = [  # (applies, zero, problem, fix)
        (p.zero == 3 and p.grid.pp_enabled and p.pipeline_schedule.split_backward, 3,
         f"with pp_schedule {p.pp_schedule!r} gives wrong gradients: its deferred weight-gradient pass "
         "runs after FSDP2 has resharded the parameters (PyTorch issue 164756)",
         "use zero: 2 with this schedule, or pp_schedule: interleaved_1f1b with zero: 3"),
    ]
    for applies, zero, problem, fix in refused:
        if applies:
            raise SpecError("parallel.zero", zero, problem, fix)


def check_precision(job: JobSpec) -> None:
    """``precision.policy`` and ``reduce_dtype``: FSDP2's mixed-precision policy needs bf16 and FSDP2's units
    (``workers/parallel/mixed_precision.py``); a field that could never take effect is refused, not ignored."""
    pr, p = job.precision, job.parallel
    if pr.policy != "auto" and pr.dtype == "fp32":
        raise SpecError("precision.policy", pr.policy, "picks how bf16 (or fp16) computes, and precision.dtype is fp32",
                        "set precision.dtype: bf16, or remove precision.policy")
    if pr.policy == "fsdp" and not fsdp_applies(pr.dtype, p.zero, p.dp_sync):
        why = (f"needs precision.dtype bf16 (fp16 needs loss scaling, which runs under autocast), not {pr.dtype!r}"
               if pr.dtype != "bf16" else
               f"needs FSDP2's units (parallel.zero 2 or 3 with dp_sync allreduce); this job has zero: {p.zero}, "
               f"dp_sync: {p.dp_sync}")
        raise SpecError("precision.policy", "fsdp", why, "set parallel.zero: 2 or 3 (dp_sync: allreduce) with "
                        "precision.dtype: bf16, or precision.policy: autocast")
    if pr.reduce_dtype != "fp32" and not planned_fsdp_mixed(pr.dtype, pr.policy, p.zero, p.dp_sync, p.device):
        raise SpecError("precision.reduce_dtype", pr.reduce_dtype, "is the gradient reduction dtype of FSDP2's "
                        "mixed-precision policy, which this job does not run (it needs precision.dtype bf16, "
                        "parallel.zero 2 or 3, and precision.policy fsdp, or auto on a GPU)",
                        "remove precision.reduce_dtype, or set precision.policy: fsdp with zero 2 or 3 (ZeRO-0 "
                        "compresses its buckets with parallel.grad_compression: bf16)")


def _changed(section, field: str) -> bool:
    """Whether ``field`` differs from its default (a value, not ``model_fields_set``: specs round-trip through
    ``to_dict``, which writes every field)."""
    return getattr(section, field) != type(section).model_fields[field].default


def check_settings_without_their_feature(job: JobSpec) -> None:
    """A setting read only by a feature this job does not run is refused, not ignored: the user believes it shapes
    the run. ``pp_schedule`` without a pipeline (an interleaved schedule at pp=1 would also count two stages, then
    refuse the layer count or tied embeddings for a pipeline that never runs), ``cp_impl`` without context
    parallelism, ``initial_loss_scale`` without fp16's loss scaling. The asynchronous schedules refuse pp=1 in
    ``check_async_pipeline``, naming what they need. Likewise settings of the offload store, the Prometheus
    endpoint, the held-out loss and the optimizer (``workers/optim/build.py`` reads ``momentum`` for
    sgd and sm3 only, ``betas`` for the Adam family only; ``min_lr_ratio`` is the decaying schedules' floor,
    ``decay_steps``/``decay_ratio``/``decay_shape`` wsd's decay) when the job runs none of them."""
    p, pr = job.parallel, job.precision
    inert = [*_inert_settings(job),   # (field, value, ignored, what it sets and why this job has none, fix)
        ("parallel.pp_schedule", p.pp_schedule, p.pp == 1 and p.pp_schedule not in ASYNC,
         "orders a pipeline's microbatches, and this job has parallel.pp: 1 (no pipeline)",
         "set parallel.pp: 2 or more, or remove parallel.pp_schedule"),
        ("parallel.cp_impl", p.cp_impl, p.cp == 1, "joins the context-parallel shares of attention, and this job "
         "has parallel.cp: 1", "set parallel.cp: 2 or more, or remove parallel.cp_impl"),
        ("precision.initial_loss_scale", pr.initial_loss_scale, pr.dtype != "fp16", "is fp16's first loss scale, "
         f"and this job has precision.dtype: {pr.dtype} (no loss scaling)",
         "set precision.dtype: fp16, or remove precision.initial_loss_scale"),
    ]
    for field, value, ignored, why, fix in inert:
        *sections, name = field.split(".")
        if ignored and _changed(reduce(getattr, sections, job), "async_save" if name == "async" else name):
            raise SpecError(field, value, why, fix)


def _inert_settings(job: JobSpec) -> list[tuple]:
    """`check_settings_without_their_feature`'s rows for the offload store, metrics, eval and optim. Not those of
    checkpoints: checkpoints are on by default, so ``checkpoint.every: 0`` is always a deliberate off (often a
    ``--set`` for a quick run of a job file that sets ``keep``), and ``keep``/``async`` then mislead nobody."""
    off, m, o = job.memory.offload, job.metrics, job.optim
    stored = off.optimizer or off.params or off.activations or o.name == "paged_adamw"
    no_store = ("places what memory.offload moves, and this job offloads nothing (memory.offload.optimizer, "
                "params and activations are false, optim.name is not paged_adamw)")
    no_port = "belongs to the Prometheus endpoint, and metrics.port is unset (no endpoint)"
    local = job.parallel.dp_sync == "allreduce"  # with shards, parameter_server.optimizer may read them
    return [
        *[(f"memory.offload.{k}", getattr(off, k), not stored, no_store, "set memory.offload.optimizer (or params, "
           f"activations) to true, or remove memory.offload.{k}") for k in ("tier", "prefetch")],
        *[(f"metrics.{k}", getattr(m, k), m.port is None, no_port, "set metrics.port (0: any free port), or "
           f"remove metrics.{k}") for k in ("host", "file_sd")],
        ("eval.batches", job.eval.batches, job.eval.every == 0, "sizes each held-out evaluation, and eval.every is 0 "
         "(never evaluates)", "set eval.every and eval.path, or remove eval.batches"),
        ("optim.momentum", o.momentum, local and o.name not in ("sgd", "sm3"), f"is read by optim.name sgd and "
         f"sm3 only, not {o.name!r}", "remove optim.momentum (set optim.betas for the Adam family), or use sgd"),
        ("optim.betas", list(o.betas), local and o.name in ("sgd", "sm3", "adafactor"), "are the Adam family's "
         f"moment decays, and optim.name {o.name!r} does not read them", "remove optim.betas (sgd and sm3 take "
         "optim.momentum)"),
        ("optim.weight_decay_exclude", o.weight_decay_exclude, o.weight_decay == 0, "chooses the parameters "
         "optim.weight_decay spares, and optim.weight_decay is 0 (nothing decays)", "set optim.weight_decay, or "
         "remove optim.weight_decay_exclude"),
        *[(f"optim.{k}", getattr(o, k), o.name != "muon", f"is read by optim.name muon only, not {o.name!r}",
           f"remove optim.{k}, or set optim.name: muon") for k in ("muon_momentum", "muon_nesterov", "muon_ns_steps")],
        ("optim.min_lr_ratio", o.min_lr_ratio, o.schedule == "constant", "is the floor the cosine, linear and wsd "
         "schedules decay to, and optim.schedule is constant", "set optim.schedule: cosine (or linear, wsd), or "
         "remove optim.min_lr_ratio"),
        *[(f"optim.{k}", getattr(o, k), o.schedule != "wsd", f"shapes the wsd schedule's decay, and optim.schedule "
           f"is {o.schedule}", f"set optim.schedule: wsd, or remove optim.{k}")
          for k in ("decay_steps", "decay_ratio", "decay_shape")],
    ]


def check_comm(job: JobSpec) -> None:
    """ZeRO-0's bucket and compression settings, and 1-bit Adam: where they apply (workers/parallel/grad_buckets.py)."""
    p, name = job.parallel, job.optim.name
    zero0 = p.zero == 0 and p.dp_sync == "allreduce"
    where = "ZeRO-0's gradient buckets (parallel.zero: 0, dp_sync: allreduce)"
    for field in ("bucket_mb", "grad_compression"):
        if _changed(p, field) and not zero0:
            raise SpecError(f"parallel.{field}", getattr(p, field), f"is only used by {where}; this job has "
                            f"zero: {p.zero}, dp_sync: {p.dp_sync}", f"remove parallel.{field}, or use zero: 0"
                            + (" (the shards' wire has parameter_server.compression)" if p.dp_sync == "ps" else ""))
    if p.grad_compression != "none" and not p.grid.dp_enabled:
        raise SpecError("parallel.grad_compression", p.grad_compression, "has nothing to compress with "
                        "parallel.dp=1 (gradients cross only the data-parallel group)",
                        "set parallel.dp above 1, or grad_compression: none")
    for field, kind in (("powersgd_rank", "powersgd"), ("powersgd_warmup_steps", "powersgd"), ("topk_ratio", "topk")):
        if _changed(p, field) and p.grad_compression != kind:
            raise SpecError(f"parallel.{field}", getattr(p, field), f"is only read by grad_compression: {kind}, "
                            f"not {p.grad_compression!r}", f"set parallel.grad_compression: {kind}, or remove {field}")
    warmup = p.powersgd_warmup_steps
    if p.grad_compression == "powersgd" and warmup >= job.train.steps:
        default = "" if _changed(p, "powersgd_warmup_steps") else "(the default) "
        raise SpecError("parallel.powersgd_warmup_steps", warmup, f"{default}leaves none of train.steps "
                        f"{job.train.steps} compressed: the first {warmup} steps all-reduce plainly",
                        f"set parallel.powersgd_warmup_steps below {job.train.steps} (0 compresses from the first "
                        "step), or train longer")
    if name != "onebit_adam":
        return
    refused = [  # (field, value, applies, why, fix)
        ("parallel.zero", p.zero, not zero0, "its compressed momentum replaces ZeRO-0's gradient all-reduce",
         "set parallel.zero: 0 with dp_sync: allreduce"),
        ("parallel.grad_compression", p.grad_compression, p.grad_compression != "none",
         "it compresses its own traffic (1 bit per parameter after warm-up)", "set grad_compression: none"),
        ("parallel.tp", p.tp, p.grid.tp_enabled, "its sign compression packs plain (not tensor-parallel) tensors",
         "set parallel.tp: 1"),
        ("optim.warmup_steps", job.optim.warmup_steps, job.optim.warmup_steps == 0,
         "its second moment is measured during warm-up, then frozen", "set optim.warmup_steps (e.g. 10% of steps)"),
    ]
    for field, value, applies, why, fix in refused:
        if applies:
            raise SpecError(field, value, f"cannot be combined with optim.name onebit_adam: {why}", fix)


def check_expert_parallel(job: JobSpec) -> None:
    """``parallel.ep`` needs MoE layers whose experts it divides, and a data-parallel mode that reduces the
    experts over the ranks holding them (``workers.parallel.expert_parallel``); ``ep`` dividing dp is the
    parallel section's own check."""
    p, moe = job.parallel, getattr(job.model, "moe", None)
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
        ("parallel.cp", p.cp, p.cp > 1, "with parallel.ep > 1 is not supported yet: the experts' gradients are "
         "averaged over the dp ranks holding them, not over cp", "use parallel.cp: 1, or parallel.ep: 1"),
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


def check_pipeline_split(job: JobSpec) -> None:
    """Tied weights need one stage; ``parallel.pp_split`` must cut ``model.n_layers`` into the stages."""
    p, n_layers = job.parallel, job.model.n_layers
    spr = p.stages_per_rank
    stages = p.pp * spr
    if job.model.tie_embeddings and stages > 1:
        raise SpecError("model.tie_embeddings", True,
                        f"with {stages} pipeline stages cannot share one weight: the embedding is on the first "
                        "stage and the output head on the last",
                        "set model.tie_embeddings: false, or parallel.pp: 1 (one stage per rank)")
    if isinstance(p.pp_split, list):
        problem = split_problem(p.pp_split, n_layers, stages)
        if problem:
            raise SpecError("parallel.pp_split", p.pp_split, problem,
                            f"give {stages} layer counts (parallel.pp * stages_per_rank = {p.pp} * {spr}), each at "
                            f"least 1, summing to model.n_layers={n_layers}; or use pp_split: auto")
        return
    if p.pp_split == "auto":
        if n_layers < stages:
            raise SpecError("parallel.pp_split", "auto", f"cannot give each of {stages} pipeline stages a layer: "
                            f"model.n_layers is {n_layers}", f"use at most {n_layers} stages (parallel.pp * "
                            "stages_per_rank), or more layers")
        return
    if n_layers % stages == 0:
        return
    fixes = [f"set model.n_layers to a multiple of {stages} (e.g. {_near_multiples(n_layers, stages)})",
             "set parallel.pp_split: auto (or a list of layer counts) for uneven stages"]
    pps = [q for q in _divisors(n_layers) if n_layers % (q * spr) == 0]
    if pps:
        fixes.append(f"pick parallel.pp from {pps}")
    if spr > 1:
        fixes.append("use pp_schedule: 1f1b (one stage per rank)")
    raise SpecError(
        "model.n_layers",
        n_layers,
        f"does not split evenly into parallel.pp * stages_per_rank = {p.pp} * {spr} = {stages} pipeline stages",
        ", or ".join(fixes),
    )


def check_tensor_split(job: JobSpec) -> None:
    m, p = job.model, job.parallel
    dims = {
        "model.n_heads": m.n_heads,
        "model.d_model": m.d_model,
        # grouped K/V heads are split over tp, never replicated (workers.model.llama_parallel)
        **({"model.n_kv_heads": m.kv_heads} if m.n_kv_heads is not None else {}),
        "model.d_ff" if m.d_ff is not None else "model.ffn_dim (4*d_model)": m.ffn_dim,
    }  # model.vocab_size need not divide: it is padded to a multiple of tp (JobSpec.padded_vocab_size)
    if p.sequence_parallel:
        dims["model.seq_len (split by sequence_parallel)"] = m.seq_len
    bad = [f"{k}={v}" for k, v in dims.items() if v % p.tp]
    if not bad:
        return
    valid = [t for t in _divisors(min(dims.values())) if all(v % t == 0 for v in dims.values())]
    fix = f"pick parallel.tp from {valid}, or change the listed model sizes to multiples of {p.tp}"
    if p.sequence_parallel and m.seq_len % p.tp:
        fix += ", or set parallel.sequence_parallel: false"
    raise SpecError("parallel.tp", p.tp, f"does not divide {', '.join(bad)}", fix)


def check_init_from_vocab(job: JobSpec) -> None:
    """A Hugging Face checkpoint's vocabulary must split evenly over `parallel.tp`: it is not padded as a model
    trained from scratch is (`JobSpec.padded_vocab_size`), because the padded rows of a loaded output head would
    add logits to the softmax that transformers' model does not have, and the loss and gradients would differ."""
    m, tp = job.model, job.parallel.tp
    if m.init_from is None or m.vocab_size % tp == 0:
        return
    shape = (m.n_heads, m.d_model, m.kv_heads, m.ffn_dim)
    valid = [t for t in _divisors(m.vocab_size) if all(v % t == 0 for v in shape)]
    raise SpecError("parallel.tp", tp, f"does not divide vocab_size = {m.vocab_size} of model.init_from "
                    f"{m.init_from}/config.json; a loaded vocabulary is not padded (padded rows would add logits "
                    "transformers' model does not have)", f"pick parallel.tp from {valid}, or resize the "
                    f"checkpoint's vocabulary to a multiple of {tp} (transformers' resize_token_embeddings)")


def pipeline_problem(job: JobSpec, microbatches: int) -> str | None:
    """Why a pipeline schedule cannot run `microbatches` microbatches, or None if it can."""
    pp, schedule, facts = job.parallel.pp, job.parallel.pp_schedule, job.parallel.pipeline_schedule
    if pp == 1:
        return None
    if facts.interleaved and microbatches % pp:
        return f"is not a multiple of parallel.pp={pp}, which pp_schedule {schedule!r} requires"
    if facts.min_microbatches_per_pp > 1 and microbatches < facts.min_microbatches(pp):
        # one microbatch per stage: the V-shaped dualpipev runs two stages a rank
        return (
            f"is below the {facts.min_microbatches(pp)} pipeline stages of pp_schedule {schedule!r} (two per rank); "
            f"it needs microbatches >= {facts.min_microbatches_per_pp}*pp"
        )
    if microbatches < pp:
        return (
            f"is below parallel.pp={pp}; pp_schedule {schedule!r} needs at least one microbatch "
            "per pipeline rank (microbatches >= pp)"
        )
    return None


def check_batching(job: JobSpec) -> None:
    t, dp, pp = job.train, job.parallel.dp, job.parallel.pp
    gbs, mb = t.global_batch_size, t.microbatches
    if gbs % dp:
        dps = [d for d in _divisors(gbs) if (gbs // d) % mb == 0]
        raise SpecError(
            "train.global_batch_size",
            gbs,
            f"is not divisible by parallel.dp={dp}",
            f"use a multiple of dp*microbatches = {dp * mb} (e.g. {_near_multiples(gbs, dp * mb)}), "
            f"or pick parallel.dp from {dps}",
        )
    per_rank = gbs // dp
    valid = [m for m in _divisors(per_rank) if pipeline_problem(job, m) is None]
    if valid:
        fix = f"pick train.microbatches from {valid}"
    else:
        step = dp * pp
        fix = (
            f"raise train.global_batch_size to a multiple of dp*pp = {step} "
            f"(e.g. {_near_multiples(gbs, step)[-1]}) and set train.microbatches: {pp}"
        )
    if per_rank % mb:
        raise SpecError(
            "train.microbatches",
            mb,
            f"does not divide the per-data-rank batch global_batch_size/dp = {gbs}/{dp} = {per_rank}",
            fix,
        )
    problem = pipeline_problem(job, mb)
    if problem:
        raise SpecError("train.microbatches", mb, problem, fix)


CROSS_FIELD_CHECKS = (check_settings_without_their_feature, check_pipeline_split, check_tensor_split,
                      check_init_from_vocab, check_batching, check_zero, check_precision,
                      check_recompute, check_faults, check_muon, check_parameter_server, check_offload, check_lora,
                      check_context_parallel, check_document_mask, check_comm, check_moe, check_expert_parallel,
                      check_async_pipeline, check_ps_resize, check_compile, check_optim_implementation,
                      check_fsdp_prefetch, check_eval, check_loss_chunks, check_dpo)
