"""What `train.loss_chunks` (the head and cross entropy per chunk of tokens, `workers/model/gpt.py::chunked_lm_loss`)
cannot serve, refused before start.

Chunks cut each rank's share of a sequence (`model.seq_len` over `parallel.cp`; sequence parallelism gathers its
split first), so more chunks than tokens would leave chunks empty. PipeDream's schedules run a stage's forward on
a stashed weight version (`workers/parallel/async_pipeline.py`), and a head the loss runs after that forward would
use the current weights instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from orchestrator.spec.checks.async_pipeline import ASYNC

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


def check_loss_chunks(job: JobSpec) -> None:
    """More chunks than a rank's tokens per sequence, or chunks under an asynchronous pipeline, are refused."""
    chunks, p = job.train.loss_chunks, job.parallel
    if chunks == 1:
        return
    tokens = job.model.seq_len // p.cp
    if chunks > tokens:
        share = f"model.seq_len {job.model.seq_len}" + (f" / parallel.cp {p.cp}" if p.cp > 1 else "")
        raise SpecError("train.loss_chunks", chunks, f"is more than the {tokens} tokens of each rank's sequence "
                        f"({share}): chunks would be empty", f"use at most {tokens}")
    if p.pp > 1 and p.pp_schedule in ASYNC:
        raise SpecError("train.loss_chunks", chunks, f"cannot combine with parallel.pp_schedule: {p.pp_schedule}: "
                        "its stages run forward on stashed weight versions, and the head the chunked loss runs "
                        "would read the current ones", "set train.loss_chunks: 1, or a synchronous schedule "
                        "(1f1b, gpipe, interleaved_1f1b)")
