"""What a GPU job runs when its file leaves ``memory.recompute`` or ``train.compile`` unset: the fast settings the
planner's memory model says fit, instead of the cautious ones.

Measured on one H200 (benchmarks/results/gpu_h200.json): a 1B Llama that fits without recompute ran at 36.5% MFU
eager under full recompute and 54.1% compiled without it. So, for the fields the job left unset:

- ``train.compile``: on, unless the job's other settings are ones compiled blocks do not combine with (the spec's
  own ``check_compile`` refusals: a zero-bubble schedule ...) or ones compiled on CPU only so far (cp, a document
  mask, MoE: ``unproven_compiled``);
- ``memory.recompute``: the first of none, selective, full whose predicted in-step peak stays under
  (1 - ``memory.headroom``) of the device memory (``parallel.device_memory``, else this process's GPU, else
  ``plan.gpu``'s); full when none does (and the fit warning says so before start).

On a CPU (``parallel.device: cpu``, or ``auto`` where this process sees no GPU) the unset fields keep the
defaults they always had, none and off (``orchestrator.spec.unset``), so existing job files mean the same there.
The controller pins the picks before anything reads them (``pin_defaults``, beside the pipeline split) and says
what it picked and why (``event=defaults_picked``).
"""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.errors import SpecError
from orchestrator.events import event
from orchestrator.planning.estimate import estimate
from orchestrator.planning.memory_report import device_memory
from orchestrator.planning.time_model import gpu
from orchestrator.spec import JobSpec
from orchestrator.spec.checks import CROSS_FIELD_CHECKS
from orchestrator.spec.unset import value_of, with_values

RECOMPUTE_ORDER = ("none", "selective", "full")  # fastest first: each later one recomputes more of forward


def on_gpu(job: JobSpec) -> bool:
    """Whether the ranks will run on GPUs: ``cuda``, or ``auto`` where this process sees one (the ranks' rule)."""
    device = job.parallel.device
    if device != "auto":
        return device == "cuda"
    import torch

    return torch.cuda.is_available()


def memory_limit(job: JobSpec) -> int:
    """Bytes a rank may plan for: (1 - ``memory.headroom``) of the device memory."""
    return int((device_memory(job) or gpu(job.plan.gpu).memory) * (1 - job.memory.headroom))


def peak_bytes(job: JobSpec) -> int:
    """The planner's largest per-rank in-step peak for ``job`` (an ``auto`` pipeline split, pinned only once the
    model is profiled, priced as the even one)."""
    if job.parallel.pp_split == "auto":
        job = job.model_copy(update={"parallel": job.parallel.model_copy(update={"pp_split": "even"})})
    return max(r.total_bytes for r in estimate(job))


def pick_recompute(peak_of: Callable[[str], int | None], limit: int) -> tuple[str, str]:
    """The first policy of ``RECOMPUTE_ORDER`` whose ``peak_of(policy)`` is within ``limit`` (None: the job's other
    settings refuse it), and why; full when none fits (the fit warning then names the fix)."""
    tried = []
    for policy in RECOMPUTE_ORDER:
        peak = peak_of(policy)
        if peak is not None and peak <= limit:
            over = f"; {', '.join(tried)}" if tried else ""
            return policy, f"its planned peak {_gb(peak)} fits the {_gb(limit)} a rank may use{over}"
        tried.append(f"{policy} would not fit ({_gb(peak)})" if peak is not None else f"{policy} is refused")
    return "full", f"no policy fits the {_gb(limit)} a rank may use: {', '.join(tried)}"


def refusal(job: JobSpec) -> str | None:
    """None when ``job`` passes every cross-field check, else the refusal: a setting is picked only where the job
    file could have set it."""
    try:
        for check in CROSS_FIELD_CHECKS:
            check(job)
    except SpecError as refused:
        return str(refused)
    return None


def unproven_compiled(job: JobSpec) -> str | None:
    """Why compile is not picked for ``job`` although it is accepted: compiled attention operators under cp or a
    document mask, and MoE blocks compiled around their eager layer, are checked on CPU only; a default should not
    be the first run of a path on a GPU (``train.compile: true`` asks for it)."""
    p = job.parallel
    what = [name for name, on in (("parallel.cp > 1", p.grid.cp_enabled),
                                  ("model.attention_mask: document", job.model.attention_mask == "document"),
                                  ("model.moe", job.model.moe is not None)) if on]
    if not what:
        return None
    return (f"{', '.join(what)} compiled has been checked on CPU only, not yet on a GPU; set train.compile: true "
            "to run it compiled")


def pick(job: JobSpec) -> dict[str, tuple[object, str]]:
    """For the unset fields of a GPU ``job``: field -> (value, why). Compile first (it changes the activations the
    planner counts), then the lightest recompute that fits."""
    unset, picked = job.unset_fields, {}
    compile = job.train.compile
    if "train.compile" in unset:
        refused = refusal(with_values(job, {"train.compile": True})) or unproven_compiled(job)
        compile = refused is None
        picked["train.compile"] = (compile, "compiled blocks run faster (the H200 profile of issue 48)" if compile
                                   else f"the job's other settings refuse it: {refused}")
    if "memory.recompute" in unset:
        def peak_of(policy: str) -> int | None:
            candidate = with_values(job, {"memory.recompute": policy, "train.compile": compile})
            return peak_bytes(candidate) if refusal(candidate) is None else None

        picked["memory.recompute"] = pick_recompute(peak_of, memory_limit(job))
    return picked


def pin_defaults(job: JobSpec) -> tuple[JobSpec, dict[str, tuple[object, str]]]:
    """``job`` with its unset fields pinned (the fast settings on a GPU, the CPU defaults they hold elsewhere), and
    what was picked and why (empty on a CPU); each pick said as ``event=defaults_picked``."""
    if not job.unset_fields:
        return job, {}
    picked = pick(job) if on_gpu(job) else {}
    values = {path: value_of(job, path) for path in job.unset_fields}
    values.update({path: value for path, (value, _) in picked.items()})
    raw = job.to_dict()
    for path, value in values.items():
        section, field = path.split(".")
        raw[section][field] = value
    for path, (value, why) in picked.items():
        event("defaults_picked", field=path, value=value, why=why)
    return JobSpec.from_dict(raw), picked


def _gb(size: int) -> str:
    return f"{size / 1e9:.1f} GB"
