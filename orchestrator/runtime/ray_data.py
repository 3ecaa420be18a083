"""A ``ray.data.Dataset`` of token rows as a job's data: streamed once into the run dir as prepared shards.

Why shards and not the Dataset itself at every step: the loader's exact-once position in checkpoints needs a
stream it can address by sample index, the same for every dp layout and after a restart; a Dataset iterator
cannot seek. Writing the rows once (streamed: one batch of rows at a time, never the whole Dataset) gives the
ranks the same random access, checksums and resume as a `raymesh prepare-data` directory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec
from workers.data import write_token_rows

DATA_DIR = "ray_data"  # under the run dir
BATCH_ROWS = 1024


def dataset_rows(dataset, column: str) -> Iterator[np.ndarray]:
    """The ``column`` of each row (a list or array of token ids), in the Dataset's order, batch by batch."""
    for batch in dataset.iter_batches(batch_format="numpy", batch_size=BATCH_ROWS):
        if column not in batch:
            raise SpecError("dataset", f"columns {sorted(batch)}", f"has no {column!r} column of token ids",
                            f"map the Dataset to a {column!r} column of token-id lists, or pass column=")
        yield from (_token_row(row, column) for row in batch[column])


def _token_row(row, column: str) -> np.ndarray:
    """One row's ids as a 1-D integer array. A scalar, text, floats or a nested list is refused naming what the
    column holds (the shard writer would fail on it with a bare TypeError, or silently truncate floats)."""
    ids = np.asarray(row)
    if ids.ndim == 1 and (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        return ids
    held = (f"single {ids.dtype} values" if ids.ndim == 0 else
            f"{ids.ndim}-D arrays" if ids.ndim > 1 else f"lists of {ids.dtype}")
    raise SpecError("dataset", f"column {column!r} of {held}", "is not a list of integer token ids per row",
                    f"map each row's {column!r} to a list of token ids (text: tokenize it first, or write it to files "
                    "and use `raymesh prepare-data`)")


def with_ray_dataset(spec: JobSpec, dataset, resume: bool, column: str = "tokens") -> JobSpec:
    """``spec`` with ``data.path`` at the run dir's copy of ``dataset`` (ids below ``model.vocab_size``).

    A resumed run reuses the copy it trained on, so its saved position means the same samples even if the
    Dataset's order is not deterministic; a fresh run writes it again.
    """
    if spec.data.mix:  # the Dataset becomes data.path: it would replace the mixture, not join it
        raise SpecError("data.mix", f"{len(spec.data.mix)} sources", "is set, but a ray.data.Dataset handed to "
                        "TrainingJob(dataset=) replaces the job's data with its one copy in the run dir",
                        "blend the sources into the Dataset before handing it over (ray.data's union), or prepare "
                        "each with `raymesh prepare-data` and train on data.mix without a Dataset")
    out = spec.resolved_run_dir() / DATA_DIR
    if not (resume and (out / "manifest.json").is_file()):
        write_token_rows(dataset_rows(dataset, column), out, spec.model.vocab_size, source=f"ray.data:{dataset}")
    raw = spec.to_dict()
    return JobSpec.from_dict({**raw, "data": {**raw["data"], "path": str(Path(out).resolve())}})
