"""Integrity of the job's inputs, checked on the driver before any actor starts (`check_before_start`).

Prepared data: every local shard against its manifest entry (SHA-256, and the token count its Parquet footer
gives) and the manifest's total, which the ranks would otherwise refuse 10-40 s in, inside a Ray traceback; a
manifest without checksums is named in a warning (once per process), since nothing can tell its shards were
changed. An object-store prefix is left to the ranks, which read it with their own credentials and check the same.

`model.init_from`: the safetensors headers only (a file cut short, a tensor missing, of another shape or of a
dtype that is no float's, a head the tied model would drop), so a 405B checkpoint is checked in seconds; whether
the values are finite only reading them tells, which each rank does on the slices it reads
(`workers.model.hf_io.load_hf_weights`), failing the job at start naming the file and tensor.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.errors import SpecError
from orchestrator.events import event
from workers.data import checksums
from workers.storage import is_url, location

_WARNED: set[str] = set()  # manifests named by warn_unchecked in this process


def _refused(field: str, value: str, problem: str) -> SpecError:
    return SpecError(field, value, f"holds damaged data: {problem}",
                     f"{checksums.REPREPARE.replace('this directory', value)}, or point {field} at an intact copy")


def parquet_rows(path: Path) -> int | str:
    """The rows (tokens) the Parquet footer of ``path`` records, or why it cannot be read as Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows
    except (OSError, pa.ArrowException) as exc:
        return f"data shard {path} is not a Parquet file pyarrow can read ({exc})"


def check_shards_intact(field: str, value: str, manifest: dict) -> None:
    """Each shard of the local prepared directory `value` (the job's `field`) holds the bytes its checksum says and
    the tokens its entry says, and they add up to the manifest's total."""
    root = location(value)
    if is_url(root) or not manifest.get("shards"):  # none listed: the loader refuses it (workers.data.manifest)
        return
    warn_unchecked(field, value, manifest)
    counted = 0
    for shard in manifest["shards"]:
        path = root / shard["file"]
        rows = parquet_rows(path)
        problem = checksums.shard_problem(root, shard) or (
            rows if isinstance(rows, str) else checksums.count_problem(path, rows, shard["tokens"]))
        if problem is not None:
            raise _refused(field, value, problem)
        counted += rows
    problem = checksums.count_problem(f"the shards of {value}", counted, manifest["total_tokens"],
                                      "its manifest.json total_tokens")
    if problem is not None:
        raise _refused(field, value, problem)


def check_init_from(spec) -> None:
    """`model.init_from`'s weights fit the job's model as far as their headers tell (`hf_io.check_hf_weights`)."""
    if spec.model.init_from is None:
        return
    from orchestrator.spec.lora import meta_model
    from workers.model.hf_io import check_hf_weights

    try:
        check_hf_weights(meta_model(spec.model), spec.model.init_from)
    except (ValueError, KeyError) as exc:
        problem, _, fix = str(exc).strip("'\"").partition("; fix: ")
        raise SpecError("model.init_from", spec.model.init_from, f"does not hold this model's weights: {problem}",
                        fix or "point it at the Hugging Face directory the job's model section describes") from None


def warn_unchecked(field: str, value: str, manifest: dict) -> bool:
    """An `event=data_unchecked` line, once per manifest in this process, when its shards carry no checksums."""
    key = str(Path(value).resolve()) if not is_url(value) else value
    if not checksums.unchecked(manifest) or key in _WARNED:
        return False
    _WARNED.add(key)
    event("data_unchecked", field=field, manifest=f"{value.rstrip('/')}/manifest.json",
          problem=f"lists shards without a {checksums.FIELD} checksum, so changed or cut shards train unnoticed",
          fix=f"run `raymesh prepare-data` again for {value}")
    return True
