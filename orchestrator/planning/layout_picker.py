"""Pick the fastest runnable layout of a job for a cluster shape, and say why the others lost.

The search (``layout_search``) prices every dp × tp × pp × ZeRO × micro-batch × recompute × schedule
(× ``dp_shard`` under ZeRO 1-3: shard groups inside a node, ``hybrid_shard_sizes``) split of the GPUs by
predicted step time (``time_model``: compute, exposed communication per link class, pipeline bubble) and keeps
those whose in-step peak stays under (1 - ``memory.headroom``) of the GPU's
memory. Here it runs over the layouts raymesh can run today (context parallelism only for sequences of
``LONG_SEQUENCE`` tokens or more, where Llama 3 turns it on), and the winner is the first that the job file
accepts (``with_overrides`` validates it; refusals are listed with the spec's own reason). The unrestricted
search (context parallelism at any length) is reported beside it when it would be faster.

Stage splits: every pipelined layout is priced with the even split (where the layers divide the stages) and
with the split of ``pp_split: auto``'s program (``balanced_layers``, over ``stage_split.unit_times``: the
profiled costs when the job asks for ``auto``), which lowers the slowest stage where the head or embedding
outweighs a block; a layout that does not fit is priced again on the fastest split that does
(``Evaluator.fitting_split``). The winner's split goes into the job as ``parallel.pp_split``.

For an MoE model the search also tries every expert-parallel degree dividing dp × cp and the expert count
(``layout_search.expert_degrees``), each priced with its routed experts split over ep (their state sharded over
the dp × cp / ep ranks holding them), its MoE activations and all-to-all buffers, and its dispatch and combine
all-to-alls on NVLink where placement packs the expert group into a node (``time_model.expert_link``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.errors import SpecError
from orchestrator.planning import layout_search as ls
from orchestrator.planning import time_model as tm
from orchestrator.planning.estimate import RankEstimate, peak_rank
from orchestrator.planning.stage_split import unit_times
from orchestrator.spec import JobSpec
from orchestrator.spec.sections import ParallelSpec
from orchestrator.units import human_bytes

LONG_SEQUENCE = 16384  # tokens from which the picker tries context parallelism (Llama 3 turns it on for 128K)


@dataclass
class Choice:
    spec: JobSpec
    peak: RankEstimate
    reason: str
    tried: list[str] = field(default_factory=list)
    candidate: ls.Candidate | None = None
    result: ls.SearchResult | None = None
    unrestricted: ls.Candidate | None = None  # faster on paper, not picked (context parallelism below LONG_SEQUENCE)


def plan_gpu(spec: JobSpec, gpus_per_node: int, gpu_mem: int | None, gpu_type: str | None = None) -> tm.GPU:
    """The GPU type's defaults (``plan.gpu``), with the job's and the command line's overrides."""
    p = spec.plan
    gbps = {k: None if v is None else v * 1e9 for k, v in (("intra_bw", p.intra_node_gbps),
                                                          ("inter_bw", p.inter_node_gbps))}
    return tm.gpu(gpu_type or p.gpu).with_overrides(memory=gpu_mem, gpus_per_node=gpus_per_node, **gbps)


def overrides(c: ls.Candidate, shape: ls.Shape) -> list[str]:
    """The job-file settings of candidate ``c``. At cp=1 ``cp_impl`` goes back to its default: the job's own
    choice for its cp>1 layout would be refused as a setting without its feature. ``dp_shard`` is set or cleared
    (an empty value: none), so the job's own never survives onto a dp it may not divide."""
    lay = c.layout
    no_cp = [f"parallel.cp_impl={ParallelSpec.model_fields['cp_impl'].default}"] if lay.cp == 1 else []
    return [f"parallel.dp={lay.dp}", f"parallel.pp={lay.pp}", f"parallel.cp={lay.cp}", f"parallel.tp={lay.tp}",
            f"parallel.ep={lay.ep}",
            f"parallel.zero={lay.zero}", f"parallel.dp_shard={lay.dp_shard or ''}", *no_cp,
            f"parallel.pp_schedule={lay.schedule}", f"parallel.pp_split={split_value(lay)}",
            f"train.microbatches={lay.microbatches(shape)}", f"memory.recompute={lay.recompute}"]


def split_value(lay: ls.Layout) -> str:
    """``parallel.pp_split`` of a layout as an override value: its layer counts, or ``even``."""
    return f"[{','.join(map(str, lay.split))}]" if lay.split else "even"


def pick_layout(spec: JobSpec, nodes: int, gpus_per_node: int, gpu_mem: int | None = None,
                gpu_type: str | None = None) -> Choice:
    """The fastest layout that fits with headroom and that the job file accepts."""
    g = plan_gpu(spec, gpus_per_node, gpu_mem, gpu_type)
    world, shape = nodes * gpus_per_node, ls.Shape.of(spec)
    kw = {"headroom": spec.memory.headroom, "efficiency": spec.plan.efficiency}
    cps = None if shape.seq >= LONG_SEQUENCE else [1]  # cp: the search's own degrees, long sequences only
    kw["units"] = unit_times(spec)
    result = ls.search(shape, world, g, cps=cps, even_splits=True, **kw)
    tried = []
    for cand in result.best:
        try:
            chosen = spec.with_overrides(overrides(cand, shape))
        except SpecError as exc:
            tried.append(f"{cand.layout.label()}: not runnable ({exc.field}: {exc.problem})")
            continue
        peak = peak_rank(chosen)
        t = cand.time
        ep = f", routed experts split over ep={chosen.parallel.ep}" if chosen.parallel.ep > 1 else ""
        reason = (f"fastest of {result.considered} layouts that fit in {human_bytes(result.limit)} "
                  f"({spec.memory.headroom:.0%} headroom): {t.total:.3g} s/step (compute {t.compute:.3g}, bubble "
                  f"{t.bubble:.3g}, exposed communication {sum(t.exposed.values()):.3g}); peak rank {peak.rank} "
                  f"needs {human_bytes(peak.total_bytes)}{ep}")
        free = ls.search(shape, world, g, top=1, even_splits=True, **kw).best
        faster = free[0] if free and free[0].step_s < cand.step_s * 0.99 else None
        return Choice(chosen, peak, reason, tried, cand, result, faster)
    free = ls.search(shape, world, g, top=1, even_splits=True, **kw).best
    raise _no_fit(spec, nodes, gpus_per_node, g, result, tried, free[0] if free else None)


def _no_fit(spec: JobSpec, nodes: int, gpus_per_node: int, g: tm.GPU, result: ls.SearchResult,
            tried: list[str], unrestricted: ls.Candidate | None) -> SpecError:
    if not result.too_big:
        return SpecError("--nodes/--gpus-per-node", f"{nodes}x{gpus_per_node}",
                         f"gives no layout this job can run ({'; '.join(tried[:3]) or _refusals(result.rejected)})",
                         "pick a GPU count that divides train.global_batch_size and model.n_layers, "
                         "or change those")
    small = result.too_big[0]
    return SpecError("--gpu-mem", human_bytes(g.memory),
                     f"is too small: no layout of {nodes} node(s) x {gpus_per_node} GPU(s) fits with "
                     f"{spec.memory.headroom:.0%} headroom; the smallest, {small.layout.label()}, needs "
                     f"{human_bytes(small.peak)} on pp rank {small.peak_pp_rank}"
                     + (f" (with context parallelism below {LONG_SEQUENCE} tokens, which the picker leaves out, "
                        f"{unrestricted.layout.label()} would fit: {human_bytes(unrestricted.peak)})"
                        if unrestricted else ""),
                     f"use --gpu-mem {human_bytes(small.peak / (1 - spec.memory.headroom))} or more, add --nodes, "
                     "lower memory.headroom, or lower train.global_batch_size", where="raymesh plan")


def _refusals(rejected: dict[str, int]) -> str:
    """Why the search priced no layout, in words ("3 layouts: global batch not divisible by dp; ..."), most first."""
    counts = sorted(((n, why) for why, n in rejected.items() if n), reverse=True)
    return "; ".join(f"{n} layout{'s' if n > 1 else ''}: {why}" for n, why in counts) or "no layout to price"


def explain(choice: Choice, top: int = 5) -> list[str]:
    """The top choices with their time terms, then per axis the best layout that differs there and why it lost."""
    res = choice.result
    lines = [f"{'layout':<68} {'step s':>8} {'compute':>8} {'bubble':>7} {'comm':>7} {'peak':>10}"]
    for c in res.best[:top]:
        t = c.time
        lines.append(f"{c.layout.label():<68} {t.total:>8.3g} {t.compute:>8.3g} {t.bubble:>7.3g} "
                     f"{sum(t.exposed.values()):>7.3g} {human_bytes(c.peak):>10}")
    lines.append(f"why the others lost ({res.considered} priced, {res.rank_estimates} distinct rank estimates):")
    lines += [f"  {line}" for line in ls.losers_by_axis(res)]
    lines += [f"  {n} {why}" for why, n in res.rejected.items() if n]
    if choice.unrestricted is not None:
        u = choice.unrestricted
        lines.append(f"faster on paper, not picked (context parallelism below {LONG_SEQUENCE} tokens): "
                     f"{u.layout.label()}: {u.step_s:.3g} s/step, {human_bytes(u.peak)}")
    return lines
