"""Checks that need the data directory or the cluster, run just before any actor starts."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.errors import SpecError
from orchestrator.spec.job import JobSpec


def check_data_path(spec: JobSpec) -> None:
    """Fail early when `data.path` has not been prepared; kept out of validation because data may live elsewhere."""
    manifest = Path(spec.data.path) / "manifest.json"
    if not manifest.is_file():
        raise SpecError(
            "data.path",
            spec.data.path,
            f"has no prepared data ({manifest} is missing)",
            f"run `raymesh prepare-data --out {spec.data.path}`, or point data.path at a prepared directory",
        )
    check_data_vocab(spec, json.loads(manifest.read_text()))


def check_data_vocab(spec: JobSpec, manifest: dict) -> None:
    """Refuse a model whose vocabulary cannot hold the data's ids (the embedding lookup would fail mid-run)."""
    data_vocab = manifest.get("vocab_size")
    if data_vocab is None or spec.model.vocab_size >= data_vocab:
        return
    tok = manifest.get("tokenizer") or {"kind": "bytes"}
    made_by = f"tokenizer {tok['kind']}" + (f" {tok['path']}" if tok.get("path") else "")
    tp = spec.parallel.tp
    raise SpecError(
        "model.vocab_size", spec.model.vocab_size,
        f"is smaller than the vocabulary of the data in {spec.data.path} ({data_vocab} ids, {made_by})",
        f"set model.vocab_size: {data_vocab} (it is padded to {-(-data_vocab // tp) * tp}, a multiple of "
        f"parallel.tp={tp}, internally), or prepare the data with a smaller tokenizer",
    )


def check_resources(spec: JobSpec, available_cpus: float, available_gpus: float, device: str) -> None:
    """Check the cluster can host dp*pp*tp ranks before any actor is created.

    Each rank takes `parallel.cpus_per_rank` CPUs, plus one GPU when `device` is
    "cuda" ("auto" means cuda when any GPU is available).
    """
    p, grid = spec.parallel, spec.parallel.grid
    ranks = grid.world_size
    shape = f"{grid.describe()} = {ranks} ranks"
    use_gpu = device == "cuda" or (device == "auto" and available_gpus >= 1)
    if use_gpu and ranks > available_gpus:
        raise SpecError(
            "parallel.dp*pp*tp",
            ranks,
            f"needs {ranks} GPUs (one per rank, {shape}) but Ray has {available_gpus:g} available",
            f"lower parallel.dp/pp/tp so dp*pp*tp <= {int(available_gpus)}, add GPU nodes to the Ray cluster, "
            "or set parallel.device: cpu",
        )
    needed = ranks * p.cpus_per_rank
    if needed > available_cpus + 1e-9:
        fit = int(available_cpus // p.cpus_per_rank)
        fixes = [f"lower parallel.dp/pp/tp so dp*pp*tp <= {fit}"] if fit >= 1 else []
        fixes += [
            f"lower parallel.cpus_per_rank to {available_cpus / ranks:g}",
            "start Ray with more CPUs (`ray start --head --num-cpus N`) or add nodes",
        ]
        raise SpecError(
            "parallel.dp*pp*tp",
            ranks,
            f"needs {needed:g} CPUs ({shape} x parallel.cpus_per_rank={p.cpus_per_rank:g}) "
            f"but Ray has {available_cpus:g} available",
            ", or ".join(fixes),
        )
