"""``parallel.pp_split`` resolved: the layer counts per pipeline stage that the workers cut and the planner counts.

``even`` and a list are read as they are; ``auto`` profiles the job's model
(``workers.parallel.stage_profile``) and runs PipeDream's dynamic program
(``workers.parallel.partition.balanced_split``) for the contiguous split whose slowest stage is fastest, each
stage within the device memory (``parallel.device_memory``, when set).

Where the profile runs, and why: Ray-free, in a fresh child of the process that resolves the spec (``raymesh
plan``, and the controller, which ``TrainingJob`` builds in the driver or in its hosted actor), before any rank
actor starts. The child (``profile_in_fresh_process``, about a second and a half of start-up) keeps its freed
memory, so the profile does not depend on the resolving process's heap. Six resolutions of a 6-block, 32-wide
model under a 4096-word head (micro-batch 8) measured the head at 3.1-5.5 blocks in the resolving process, which
split it [5, 1] five times and [4, 2] once; in the child at 2.7-3.0 blocks, [4, 2] every time (training ranks
measured it at 1.3-1.7 blocks, so [4, 2] is the better split).
The split decides which layers each rank builds, so it must be known before the ranks build; ``raymesh plan``
needs it with no cluster; and one process measures every unit under the same conditions, which ranks that each
profile only their own stages could not (their numbers would not compare across ranks). What it costs: it
measures this host's CPU, not the ranks' accelerators; the program needs each unit's share of the time, which a
CPU gives for the matmul-bound blocks and head of a model small enough to profile on the host (a larger one is
refused, ``check_profilable``: give the counts as a list). The controller pins the result (``pin_split``), so
its regrids keep the split the run started with; a restarted controller actor profiles again, and DCP reshards
its checkpoint onto whatever split that gives (checkpoint keys are global layer names).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from orchestrator.planning import time_model as tm
from orchestrator.planning.layout_search import Shape, UnitTimes
from orchestrator.planning.memory_model import in_flight_microbatches
from orchestrator.spec import JobSpec
from workers.parallel.layout import stage_ids
from workers.parallel.partition import StageMemory, balanced_split, stage_bounds, stage_cost

if TYPE_CHECKING:  # the profiler's module imports torch; the controller and `raymesh plan` need it only to profile
    from workers.parallel.stage_profile import ModelCosts

# fp32 weights and gradients plus Adam's two moments (seed 003's 16 bytes a parameter): the program's memory
# term, per stage, beside the activations the schedule keeps in flight there
STATE_BYTES_PER_PARAM = 16


@dataclass(frozen=True)
class AutoSplit:
    """What ``pp_split: auto`` chose, and from which costs (for the log, the summary and ``raymesh plan``)."""

    split: tuple[int, ...]
    costs: ModelCosts
    stage_seconds: tuple[float, ...]  # profiled forward + backward of one microbatch through each stage
    stage_bytes: tuple[int, ...]  # the program's memory term of each stage

    def describe(self) -> str:
        times = ", ".join(f"{1e3 * t:.2f}" for t in self.stage_seconds)
        return (f"pp_split auto: {list(self.split)} layers per stage; profiled ms per microbatch and stage "
                f"[{times}] (embedding {1e3 * self.costs.embedding.time_s:.2f}, head {1e3 * self.costs.head.time_s:.2f}"
                f", blocks {1e3 * sum(u.time_s for u in self.costs.layers) / len(self.costs.layers):.2f} each)")


def resolve_split(spec: JobSpec) -> tuple[int, ...]:
    """Layers per stage (virtual stages included) for ``spec``'s ``parallel.pp_split``: ``auto`` profiled, the
    others as ``JobSpec.stage_split`` reads them."""
    if spec.parallel.pp_split == "auto" and spec.parallel.pp * spec.parallel.stages_per_rank > 1:
        return auto_split(spec).split
    return spec.stage_split


def pin_split(spec: JobSpec) -> JobSpec:
    """``spec`` with ``pp_split: auto`` replaced by the layer counts it resolves to, so every spec the controller
    derives later (a shrink, a resize to another dp, hence another microbatch size) keeps the split the run
    started with, and a checkpoint's stages stay where they were."""
    if spec.parallel.pp_split != "auto" or spec.parallel.pp * spec.parallel.stages_per_rank == 1:
        return spec
    raw = spec.to_dict()
    raw["parallel"]["pp_split"] = list(auto_split(spec).split)
    return JobSpec.from_dict(raw)


def auto_split(spec: JobSpec) -> AutoSplit:
    """Profile ``spec``'s model and solve for the split (cached on the job's shape)."""
    p, t = spec.parallel, spec.train
    return _auto_split(profiled_costs(spec), p.pp, p.stages_per_rank, p.pp_schedule, t.microbatches,
                       p.device_memory_bytes)


def profiled_costs(spec: JobSpec) -> ModelCosts:
    """``spec``'s model profiled for one of its microbatches (cached on the model, micro-batch size, seed and
    ``train.loss_chunks``, which changes what the head saves and recomputes)."""
    check_profilable(spec)
    p, t = spec.parallel, spec.train
    micro = t.global_batch_size // p.dp // t.microbatches
    model = {**spec.model.model_dump(mode="json", exclude={"lora", "init_from", "preset"}),
             "d_ff": spec.model.ffn_dim, "vocab_size": spec.padded_vocab_size}
    return _profile(json.dumps(model, sort_keys=True), micro, t.seed, t.loss_chunks)


def unit_times(spec: JobSpec) -> UnitTimes:
    """The unit costs the layout picker splits stages by (``layout_search.balanced_layers``). For a job that asks
    for ``pp_split: auto``, the profiled costs ``auto_split`` uses, so the picker prices the split the run's
    program would make. Otherwise the time model's FLOPs per token of each unit (6 x parameters, plus a block's
    attention scores; the embedding is a lookup): arithmetic, the same on every host and instant, as the rest of
    ``raymesh plan`` is, and known for models too large to profile here."""
    if spec.parallel.pp_split == "auto":
        costs = profiled_costs(spec)
        return UnitTimes(costs.embedding.time_s, tuple(u.time_s for u in costs.layers), costs.head.time_s)
    shape = Shape.of(spec)
    block = tm.flops_per_token(shape.block_params, 1, shape.d_model, shape.seq)
    return UnitTimes(0.0, (block,) * shape.n_layers, tm.flops_per_token(shape.vocab * shape.d_model, 0, 0, 0))


@functools.lru_cache(maxsize=8)
def _profile(model_json: str, micro: int, seed: int, loss_chunks: int = 1) -> ModelCosts:
    """The profile, or a ``SpecError`` on ``parallel.pp_split`` saying why it could not run and what to set."""
    from workers.parallel.stage_profile import profile_in_fresh_process

    try:
        return profile_in_fresh_process(json.loads(model_json), micro, seed, loss_chunks=loss_chunks)
    except RuntimeError as exc:
        raise SpecError("parallel.pp_split", "auto", f"could not profile the model on this host: {exc}",
                        "give the layer counts per stage as a list, or use pp_split: even") from None


@functools.lru_cache(maxsize=8)
def _auto_split(costs: ModelCosts, pp: int, spr: int, schedule: str, microbatches: int,
                limit: int | None) -> AutoSplit:
    times = [u.time_s for u in costs.layers]
    n_stages = pp * spr
    memory = stage_memory(costs, pp, spr, schedule, microbatches)
    split = balanced_split(times, n_stages, costs.embedding.time_s, costs.head.time_s, memory,
                           None if limit is None else limit / spr)
    seconds = stage_cost(times, split, costs.embedding.time_s, costs.head.time_s)
    held = [memory(s, layers.start, layers.stop) for s, layers in enumerate(stage_bounds(split))]
    return AutoSplit(split, costs, tuple(seconds), tuple(int(b) for b in held))


def check_profilable(spec: JobSpec) -> None:
    """Refuse ``auto`` for a model whose weights and gradients (8 bytes a parameter, fp32) would take more than
    a quarter of this host's memory: the profile builds the whole model here (see the module docstring)."""
    shape = Shape.of(spec)
    params = shape.n_layers * shape.block_params + 2 * shape.vocab * shape.d_model
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 8 * params > host / 4:
        even = spec.model.n_layers // (spec.parallel.pp * spec.parallel.stages_per_rank)
        raise SpecError("parallel.pp_split", "auto", f"would profile a model of {params:,} parameters on this host "
                        f"(about {8 * params / 2**30:.1f} GiB of weights and gradients, more than a quarter of its "
                        f"{host / 2**30:.0f} GiB)", f"give the layer counts per stage as a list (e.g. {even} per stage"
                        ", the heavier first and last stages one or two fewer), or use pp_split: even")


def stage_memory(costs: ModelCosts, pp: int, spr: int, schedule: str, microbatches: int) -> StageMemory:
    """The program's memory term of stage ``s`` holding layers ``[lo, hi)``: model state of its parameters, plus
    its activations times the microbatches its rank keeps in flight (``in_flight_microbatches``, shared by the
    rank's stages), plus the embedding's on the first stage and the head's (in flight once) on the last."""
    rank_of = {sid: r for r in range(pp) for sid in stage_ids(r, pp, spr, schedule)}
    n_stages = pp * spr

    def memory(stage: int, lo: int, hi: int) -> float:
        blocks = costs.layers[lo:hi]
        first, last = stage == 0, stage == n_stages - 1
        params = sum(u.params for u in blocks) + first * costs.embedding.params + last * costs.head.params
        saved = sum(u.activation_bytes for u in blocks) + first * costs.embedding.activation_bytes
        flight = max(1, in_flight_microbatches(schedule, pp, rank_of[stage], microbatches, spr) // spr)
        return STATE_BYTES_PER_PARAM * params + flight * saved + last * costs.head.activation_bytes
    return memory
