"""The `memory:` section: recompute intervals, and what the offload store (workers/offload/) can hold."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


def check_recompute(job: JobSpec) -> None:
    m = job.memory
    if m.recompute_every > 1 and m.recompute == "sqrt":
        raise SpecError("memory.recompute_every", m.recompute_every, "is chosen by memory.recompute: sqrt itself "
                        "(segments of round(sqrt(n_layers)) blocks)", "remove memory.recompute_every, or set "
                        "memory.recompute: full to pick the interval yourself")
    if m.recompute == "sqrt" and job.train.compile:
        raise SpecError("memory.recompute", "sqrt", "checkpoints segments of several compiled blocks by hooks around "
                        "them, which train.compile's per-block graphs do not trace", "set memory.recompute: full "
                        "(checkpointed inside each compiled block), or train.compile: false")
    if m.recompute_every > 1 and m.recompute == "none":
        raise SpecError("memory.recompute_every", m.recompute_every, "picks which blocks memory.recompute applies "
                        "to, and memory.recompute is 'none'", "set memory.recompute: full or selective, or "
                        "remove memory.recompute_every")


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
