"""`fault_tolerance` timeouts and floors, and each injected fault against the job it runs in."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from orchestrator.faults.soak import check_repetition
from orchestrator.spec.fields import changed

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


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
        if changed(fault, option) and fault.kind != kind:
            raise SpecError(f"{where}.{option}", getattr(fault, option), f"is read by kind {kind} only, and this "
                            f"fault is {fault.kind}", f"remove {where}.{option}, or set {where}.kind: {kind}")
