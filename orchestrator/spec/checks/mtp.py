"""Multi-token prediction (`model.mtp_layers`, `workers/model/mtp.py`) against the layout and the objective.

The modules sit on top of the main model and read the token embedding and the output head, which a pipeline puts
on different stages (the first and the last); the modules' loss is computed where the head is, so pipeline
parallelism is refused rather than run with a copy of the embedding that would drift from the first stage's. DPO
scores sequences by their next-token log-probabilities only, so MTP has no loss to add there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


def check_mtp(job: JobSpec) -> None:
    """`model.mtp_layers` > 0 under `parallel.pp` > 1, `parallel.tp` > 1 or `train.objective: dpo` is refused."""
    depths = job.model.mtp_layers
    if not depths:
        return
    if job.parallel.pp > 1:
        raise SpecError("model.mtp_layers", depths, f"needs the token embedding beside the output head, and "
                        f"parallel.pp={job.parallel.pp} puts them on the first and the last pipeline stage "
                        "(multi-token prediction under pipeline parallelism is not built)",
                        "set parallel.pp: 1 (use dp and ep), or model.mtp_layers: 0")
    if job.parallel.tp > 1:
        raise SpecError("model.mtp_layers", depths, f"has no tensor-parallel plan for its modules yet, and "
                        f"parallel.tp={job.parallel.tp} splits the head they share", "set parallel.tp: 1 (use dp "
                        "and ep), or model.mtp_layers: 0")
    if job.train.objective == "dpo":
        raise SpecError("model.mtp_layers", depths, "adds a token-prediction loss, and train.objective: dpo "
                        "trains on sequence log-probabilities only", "set model.mtp_layers: 0 for DPO")
