"""What `model.attention_mask: document` (each token attends only within its own document,
`workers.model.documents`) cannot combine with.

Checked before any actor starts, each refusal naming the field, the value and the fix. Whether the data records
an end-of-document id to count documents by is checked with the data (`runtime_checks.check_document_eos`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from orchestrator.spec.checks.async_pipeline import ASYNC

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


_OFF = "or set model.attention_mask: causal"


def check_document_mask(job: JobSpec) -> None:
    """Refuse what would train with another mask than the one asked for, or fail at the first step."""
    if job.model.attention_mask != "document":
        return
    p = job.parallel
    refused = [  # (applies, field, value, problem, fix)
        (p.pp_schedule in ASYNC, "parallel.pp_schedule", p.pp_schedule, "cannot combine with "
         "model.attention_mask: document: the asynchronous pipeline runs its own microbatches, which are not told "
         "their documents", f"use pp_schedule: 1f1b, {_OFF}"),
    ]
    for applies, field, value, problem, fix in refused:
        if applies:
            raise SpecError(field, value, problem, fix)
