"""`fault_tolerance.recovery: keep_training` against the layout it needs.

Why only plain data parallelism: the surviving replicas step on as a smaller process group and the rebuilt one
takes a live peer's whole state, which holds only where every rank is a full replica of the model and its
optimizer (zero 0, all-reduce, no error feedback or microbatches of its own) and a replica is one rank (a
pipeline, tensor, context or expert group would have to leave the grid together).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from orchestrator.spec.sections import dp_replicas_mirror

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec

FIELD = "fault_tolerance.recovery"


def check_keep_training(job: JobSpec) -> None:
    if job.fault_tolerance.recovery != "keep_training":
        return
    par, grid = job.parallel, job.parallel.grid
    if par.dp < 2:
        raise SpecError(FIELD, "keep_training", f"needs another replica to keep training, and parallel.dp={par.dp}",
                        "set parallel.dp to 2 or more, or recovery: replace_failed")
    others = {"parallel.pp": par.pp, "parallel.tp": par.tp, "parallel.cp": grid.cp, "parallel.ep": grid.ep}
    for name, value in others.items():
        if value > 1:
            raise SpecError(FIELD, "keep_training", f"runs on plain data parallelism, and {name}={value} makes a "
                            "replica several ranks that would have to leave and rejoin the grid together",
                            f"set {name}: 1, or recovery: replace_failed (bit-identical recovery of any layout)")
    if not dp_replicas_mirror(par, job.optim):
        raise SpecError(FIELD, "keep_training", f"needs every rank to hold the whole state (parallel.zero: 0, "
                        f"dp_sync: allreduce, no error-feedback compression or onebit_adam), and this job has "
                        f"zero={par.zero}, dp_sync={par.dp_sync}, grad_compression={par.grad_compression}, "
                        f"optim.name={job.optim.name}: a rebuilt replica could not take a peer's state",
                        "set parallel.zero: 0 and dp_sync: allreduce without error feedback, or recovery: "
                        "replace_failed")
    if job.checkpoint.snapshot_every(par, job.optim) == 0:
        raise SpecError("checkpoint.memory_every", 0, "turns off the in-memory snapshots the surviving replicas "
                        "roll their failed step back to under fault_tolerance.recovery: keep_training",
                        "leave checkpoint.memory_every unset (1 here) or set it to 1")
