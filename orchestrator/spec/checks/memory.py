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


def check_partitioned_activations(job: JobSpec) -> None:
    """ZeRO-R's Pa (``memory.partition_activations``, workers/parallel/partitioned_activations.py) slices the block
    input full or sqrt recompute stores; where there is no such input, or it is not replicated over tp, refused."""
    m, p = job.memory, job.parallel
    place = m.partition_activations
    if place == "none":
        if m.contiguous_checkpoints:
            raise SpecError("memory.contiguous_checkpoints", True, "lays out the slices memory.partition_activations "
                            "keeps, and it is 'none'", "set memory.partition_activations: device or host, or remove "
                            "memory.contiguous_checkpoints")
        return
    refused = [
        ("memory.recompute", m.recompute, m.recompute not in ("full", "sqrt"), "stores no whole block inputs for "
         f"memory.partition_activations {place!r} to partition", "set memory.recompute: full or sqrt, or "
         "memory.partition_activations: none"),
        ("parallel.tp", p.tp, p.tp == 1 and place == "device" and not m.contiguous_checkpoints, "leaves one "
         "tensor-parallel rank to hold the whole block input, so memory.partition_activations: device has nothing "
         "to split", "raise parallel.tp, use memory.partition_activations: host (the input in host memory), add "
         "memory.contiguous_checkpoints: true (the inputs in one buffer), or none"),
        ("parallel.sequence_parallel", True, p.tp > 1 and p.sequence_parallel, "already keeps each block input 1/tp "
         "per tp rank (split along the sequence), so memory.partition_activations has no copies to remove",
         "set parallel.sequence_parallel: false, or memory.partition_activations: none"),
        ("train.compile", True, bool(job.train.compile), "traces each block's checkpoint inside the compiled "
         "graph, and the partitioned checkpoint runs from hooks around the block", "set train.compile: false, or "
         "memory.partition_activations: none"),
    ]
    for field, value, applies, why, fix in refused:
        if applies:
            raise SpecError(field, value, why, fix)


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
    sharded = p.zero >= 2 or (p.zero == 1 and p.grid.dp_enabled) or p.grid.tp_enabled  # ZeRO-1 steps slices too
    if name == "adafactor" and sharded and job.optim.implementation == "foreach":
        raise SpecError("optim.implementation", "foreach", "is not offered for optim.name 'adafactor' on sharded "
                        "parameters (ZeRO-1/2/3 or tp): the sharded Adafactor all-reduces each matrix's row and "
                        "column statistics one tensor at a time", "use optim.implementation auto or for_loop")
    check_paging(job)
    stored_optim = off.optimizer or (name == "paged_adamw" and off.page_at is None)
    if off.params:
        check_param_offload(job, stored_optim)


PAGED = ("adamw", "adam", "sgd", "adafactor", "sm3", "paged_adamw")  # the optimizers StatePager pages


def check_paging(job: JobSpec) -> None:
    """``memory.offload.page_at`` (workers/offload/paged.py): what it cannot page, or where it relieves nothing."""
    off, name, p = job.memory.offload, job.optim.name, job.parallel
    if off.page_at is None:
        return
    refused = [
        ("memory.offload.optimizer", True, off.optimizer, "keeps the optimizer's state in the store always, so "
         "memory.offload.page_at has nothing to page", "remove one of memory.offload.optimizer and page_at"),
        ("optim.name", name, name not in PAGED, "is not paged by memory.offload.page_at (its state is not a set of "
         "tensors beside the parameters)", f"use optim.name {', '.join(PAGED)}, or remove memory.offload.page_at"),
        ("parallel.dp_sync", p.dp_sync, p.dp_sync == "ps", "steps the optimizer on the parameter-server shards, "
         "not on the ranks", "remove memory.offload.page_at"),
        ("memory.offload.tier", off.tier, p.device == "cpu" and off.tier == "cpu", "is host memory, and "
         "parallel.device cpu keeps the state in host memory already: paging there relieves nothing",
         "use memory.offload.tier: nvme (with path) on a CPU device, or a GPU"),
    ]
    for field, value, applies, why, fix in refused:
        if applies:
            raise SpecError(field, value, why, fix)


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
