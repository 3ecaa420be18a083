"""Pipeline stages: tied weights need one stage, and `parallel.pp_split` must cut `model.n_layers` into them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from orchestrator.spec.fields import _divisors, _near_multiples
from workers.parallel.partition import split_problem

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


def check_pipeline_split(job: JobSpec) -> None:
    """Tied weights need one stage; ``parallel.pp_split`` must cut ``model.n_layers`` into the stages."""
    p, n_layers = job.parallel, job.model.n_layers
    spr = p.stages_per_rank
    stages = p.n_stages
    if job.model.tie_embeddings and stages > 1:
        raise SpecError("model.tie_embeddings", True,
                        f"with {stages} pipeline stages cannot share one weight: the embedding is on the first "
                        "stage and the output head on the last",
                        "set model.tie_embeddings: false, or parallel.pp: 1 (one stage per rank)")
    if isinstance(p.pp_split, list):
        problem = split_problem(p.pp_split, n_layers, stages)
        if problem:
            raise SpecError("parallel.pp_split", p.pp_split, problem,
                            f"give {stages} layer counts ({_stages_are(p)}), each at "
                            f"least 1, summing to model.n_layers={n_layers}; or use pp_split: auto")
        return
    if p.pp_split == "auto":
        if n_layers < stages:
            raise SpecError("parallel.pp_split", "auto", f"cannot give each of {stages} pipeline stages a layer: "
                            f"model.n_layers is {n_layers}", f"use at most {n_layers} stages (parallel.pp * "
                            "stages_per_rank), or more layers")
        return
    if n_layers % stages == 0:
        return
    fixes = [f"set model.n_layers to a multiple of {stages} (e.g. {_near_multiples(n_layers, stages)})",
             "set parallel.pp_split: auto (or a list of layer counts) for uneven stages"]
    pps = [q for q in _divisors(n_layers) if n_layers % (q * spr) == 0]
    if pps:
        fixes.append(f"pick parallel.pp from {pps}")
    if spr > 1:
        fixes.append("use pp_schedule: 1f1b (one stage per rank)")
    raise SpecError(
        "model.n_layers",
        n_layers,
        f"does not split evenly into {_stages_are(p)} = {stages} pipeline stages",
        ", or ".join(fixes),
    )


def _stages_are(p) -> str:
    """Where the stage count comes from, for a message."""
    if p.stage_replicas is not None:
        return f"the entries of parallel.stage_replicas {p.stage_replicas}"
    return f"parallel.pp * stages_per_rank = {p.pp} * {p.stages_per_rank}"
