"""Pick a dp × pp × cp × tp × ZeRO layout for a cluster shape, by the seed articles' rule.

The order follows the bandwidth each kind of parallelism needs (seeds 000/003):

1. Data parallelism alone with ZeRO-0/1/2 first: ZeRO-1/2 move no more bytes than
   plain all-reduce, so they are free savings.
2. Tensor parallelism inside a node, up to 8 ranks and only as wide as divides
   the heads and the node: it needs the fastest links (NVLink) and splits both
   state and activations.
3. Then ZeRO-3: it shards state but not activations.
4. Then context parallelism (with ZeRO-2, then ZeRO-3) when the job's sequences are long: cp ranks split
   every sequence, so each holds 1/cp of every activation, which no other axis does for a long sequence
   (pipeline stages still keep ``pp`` microbatches of the first stage's activations in flight); Llama 3
   trains its 128K-token stage this way.
5. Then pipeline stages (with ZeRO-2, then ZeRO-3), and pipeline stages with context parallelism.
6. Data parallelism with what is left: dp = ranks / (tp · cp · pp).

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
LONG_SEQUENCE = 16384  # tokens from which the picker tries context parallelism (Llama 3 turns it on for 128K)


@dataclass
class Choice:
    spec: JobSpec
    peak: RankEstimate
    reason: str
    tried: list[str] = field(default_factory=list)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidates(spec: JobSpec, world: int, gpus_per_node: int):
    """(tp, pp, cp, zero, why) in the rule's order."""
    tps = [t for t in _divisors(gpus_per_node)
           if t <= TP_MAX and spec.model.n_heads % t == 0 and spec.model.kv_heads % t == 0 and world % t == 0]
    for zero in (0, 1, 2):
        yield 1, 1, 1, zero, f"plain data parallelism with ZeRO-{zero} fits"
    for tp in tps[1:]:
        for zero in (0, 2):
            yield tp, 1, 1, zero, f"tensor parallelism over {tp} GPUs of a node (ZeRO-{zero}) fits"
    tp = tps[-1]
    yield tp, 1, 1, 3, f"tp={tp} (the most a node allows) needs ZeRO-3 as well"
    for cp_tp in reversed(tps):  # the widest tp first; cp takes ranks that tp cannot (across nodes)
        for cp in _context_degrees(spec, world // cp_tp):
            for zero in (2, 3):
                yield cp_tp, 1, cp, zero, (f"tp={tp} with ZeRO-3 did not fit a {spec.model.seq_len}-token sequence; "
                                           f"{cp} context-parallel ranks splitting it (tp={cp_tp}, ZeRO-{zero}) do")
    v = spec.parallel.stages_per_rank
    pps = [pp for pp in _divisors(world // tp)[1:] if spec.model.n_layers % (pp * v) == 0]
    for pp in pps:
        for zero in (2, 3):
            yield tp, pp, 1, zero, f"tp={tp} with ZeRO-3 did not fit; {pp} pipeline stages (ZeRO-{zero}) do"
    for pp in pps:
        for cp in (c for c in _context_degrees(spec, world // tp) if (world // tp) % (pp * c) == 0):
            yield tp, pp, cp, 3, f"{pp} pipeline stages alone did not fit; with cp={cp} splitting each sequence they do"


def _context_degrees(spec: JobSpec, ranks: int) -> list[int]:
    """cp degrees worth trying: only for long sequences, dividing the ranks left and splitting the sequence
    into 2*cp chunks (the zigzag layout)."""
    if spec.model.seq_len < LONG_SEQUENCE:
        return []
    return [c for c in _divisors(ranks)[1:] if spec.model.seq_len % (2 * c) == 0]


def pick_layout(spec: JobSpec, nodes: int, gpus_per_node: int, gpu_mem: int) -> Choice:
    """First candidate that fits. The job's micro-batch size (global_batch_size / dp / microbatches
    as written) is kept; ``train.microbatches`` becomes what the new dp needs for the same global batch."""
    world = nodes * gpus_per_node
    mbs, gbs = micro_batch(spec), spec.train.global_batch_size
    tried, best = [], None
    for tp, pp, cp, zero, why in _candidates(spec, world, gpus_per_node):
        dp = world // Grid(pp=pp, cp=cp, tp=tp).positions  # the ranks one replica of this model split takes
        mb = max(gbs // (dp * mbs), pp, 1)
        name = f"dp={dp} pp={pp}{f' cp={cp}' if cp > 1 else ''} tp={tp} zero={zero}"
        try:
            cand = spec.with_overrides([f"parallel.dp={dp}", f"parallel.pp={pp}", f"parallel.cp={cp}",
                                        f"parallel.tp={tp}", f"parallel.zero={zero}", f"train.microbatches={mb}"])
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
