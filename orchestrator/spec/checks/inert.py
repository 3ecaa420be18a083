"""Settings read only by a feature this job does not run: refused, not ignored (the user believes they shape
the run)."""

from __future__ import annotations

from functools import reduce
from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from orchestrator.spec.checks.async_pipeline import ASYNC
from orchestrator.spec.fields import changed

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


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
        if ignored and changed(reduce(getattr, sections, job), "async_save" if name == "async" else name):
            raise SpecError(field, value, why, fix)


def _inert_settings(job: JobSpec) -> list[tuple]:
    """`check_settings_without_their_feature`'s rows for the offload store, metrics, eval and optim. Not those of
    checkpoints: checkpoints are on by default, so ``checkpoint.every: 0`` is always a deliberate off (often a
    ``--set`` for a quick run of a job file that sets ``keep``), and ``keep``/``async`` then mislead nobody."""
    off, m, o = job.memory.offload, job.metrics, job.optim
    stored = off.optimizer or off.params or off.activations or o.name == "paged_adamw" or off.page_at is not None
    no_store = ("places what memory.offload moves, and this job offloads nothing (memory.offload.optimizer, "
                "params and activations are false, optim.name is not paged_adamw, no page_at)")
    no_port = "belongs to the Prometheus endpoint, and metrics.port is unset (no endpoint)"
    local = job.parallel.dp_sync != "ps"  # with shards, parameter_server.optimizer may read them
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
