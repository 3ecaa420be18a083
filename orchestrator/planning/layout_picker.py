"""Pick a dp × pp × tp × ZeRO layout for a cluster shape, by the seed articles' rule.

The order follows the bandwidth each kind of parallelism needs (seeds 000/003):

1. Data parallelism alone with ZeRO-0/1/2 first: ZeRO-1/2 move no more bytes than
   plain all-reduce, so they are free savings.
2. Tensor parallelism inside a node, up to 8 ranks and only as wide as divides
   the heads and the node: it needs the fastest links (NVLink) and splits both
   state and activations.
3. Then ZeRO-3, then pipeline stages (with ZeRO-2, then ZeRO-3), until the model
   fits: ZeRO-3 shards state but not activations; pipeline stages split both.
4. Data parallelism with what is left: dp = ranks / (tp · pp).

For an MoE model each candidate is tried at ep=1 and then at each larger expert-parallel degree dividing dp and
the expert count, before the next candidate: experts' state split over ep for an all-to-all within dp.

The first candidate whose largest per-rank peak fits ``gpu_mem`` wins; each
candidate the job file cannot run (batch not divisible, ZeRO-1 with pp ...) is
skipped with the spec's own reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.errors import SpecError
from orchestrator.planning.estimate import RankEstimate, micro_batch, peak_rank
from orchestrator.planning.memory_model import human_bytes
from orchestrator.spec import JobSpec
from workers.parallel.grid import Grid

TP_MAX = 8


@dataclass
class Choice:
    spec: JobSpec
    peak: RankEstimate
    reason: str
    tried: list[str] = field(default_factory=list)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidates(spec: JobSpec, world: int, gpus_per_node: int):
    """(tp, pp, zero, why) in the rule's order."""
    tps = [t for t in _divisors(gpus_per_node)
           if t <= TP_MAX and spec.model.n_heads % t == 0 and spec.model.kv_heads % t == 0 and world % t == 0]
    for zero in (0, 1, 2):
        yield 1, 1, zero, f"plain data parallelism with ZeRO-{zero} fits"
    for tp in tps[1:]:
        for zero in (0, 2):
            yield tp, 1, zero, f"tensor parallelism over {tp} GPUs of a node (ZeRO-{zero}) fits"
    tp = tps[-1]
    yield tp, 1, 3, f"tp={tp} (the most a node allows) needs ZeRO-3 as well"
    v = spec.parallel.stages_per_rank
    for pp in _divisors(world // tp)[1:]:
        if spec.model.n_layers % (pp * v) == 0:
            for zero in (2, 3):
                yield tp, pp, zero, f"tp={tp} with ZeRO-3 did not fit; {pp} pipeline stages (ZeRO-{zero}) do"


def _with_ep(spec: JobSpec, candidates, world: int):
    """Each candidate at ep=1, then (an MoE model) at each larger ep dividing its dp and the expert count:
    expert parallelism splits the experts' weights, gradients and optimizer state over ep ranks for an
    all-to-all inside the data-parallel group, so it comes before the next, costlier candidate."""
    experts = spec.model.moe.experts if spec.model.moe is not None else 1
    for tp, pp, zero, why in candidates:
        dp = world // Grid(pp=pp, tp=tp).positions
        for ep in _divisors(dp):
            if experts % ep == 0:
                yield tp, pp, zero, ep, why if ep == 1 else f"{why} with the experts split over ep={ep} ranks"


def pick_layout(spec: JobSpec, nodes: int, gpus_per_node: int, gpu_mem: int) -> Choice:
    """First candidate that fits. The job's micro-batch size (global_batch_size / dp / microbatches
    as written) is kept; ``train.microbatches`` becomes what the new dp needs for the same global batch."""
    world = nodes * gpus_per_node
    mbs, gbs = micro_batch(spec), spec.train.global_batch_size
    tried, best = [], None
    for tp, pp, zero, ep, why in _with_ep(spec, _candidates(spec, world, gpus_per_node), world):
        dp = world // Grid(pp=pp, tp=tp).positions  # the ranks one replica of this model split takes
        mb = max(gbs // (dp * mbs), pp, 1)
        name = f"dp={dp} pp={pp} tp={tp} zero={zero}" + (f" ep={ep}" if ep > 1 else "")
        try:
            cand = spec.with_overrides([f"parallel.dp={dp}", f"parallel.pp={pp}", f"parallel.tp={tp}",
                                        f"parallel.zero={zero}", f"parallel.ep={ep}", f"train.microbatches={mb}"])
        except SpecError as exc:
            tried.append(f"{name}: not runnable ({exc.field}: {exc.problem})")
            continue
        peak = peak_rank(cand)
        if peak.total_bytes <= gpu_mem:
            reason = f"{why}: peak rank {peak.rank} needs {human_bytes(peak.total_bytes)} of {human_bytes(gpu_mem)}"
            return Choice(cand, peak, reason, tried)
        tried.append(f"{name}: rank {peak.rank} needs {human_bytes(peak.total_bytes)}")
        if best is None or peak.total_bytes < best[1].total_bytes:
            best = (name, peak)
    if best is None:
        raise SpecError("--nodes/--gpus-per-node", f"{nodes}x{gpus_per_node}",
                        f"gives no layout this job can run ({'; '.join(tried[:3])})",
                        "pick a GPU count that divides train.global_batch_size and model.n_layers, "
                        "or change those", where="raymesh plan")
    name, peak = best
    raise SpecError("--gpu-mem", human_bytes(gpu_mem),
                    f"is too small: no layout of {nodes} node(s) x {gpus_per_node} GPU(s) fits; the smallest, {name}, "
                    f"needs {human_bytes(peak.total_bytes)} on rank {peak.rank} (state {human_bytes(peak.state.peak)}, "
                    f"activations {human_bytes(peak.activation_bytes)})",
                    f"use --gpu-mem {human_bytes(peak.total_bytes)} or more, add --nodes, set memory.recompute: full, "
                    "or lower train.global_batch_size / raise train.microbatches", where="raymesh plan")
