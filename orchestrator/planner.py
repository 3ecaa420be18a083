"""Layout and a first per-rank memory estimate, before anything starts.

Model-state bytes follow the ZeRO paper's accounting (the seed articles):
per parameter 4 bytes of fp32 weights, 4 of gradients and 8 of Adam moments
(SGD with momentum: 4, plain SGD: 0); ZeRO-1 divides the optimizer state by
dp, ZeRO-2 gradients too, ZeRO-3 the weights too. Activations use Korthikanti
et al.'s per-layer count s·b·h·(34 + 5·a·s/h) bytes at 16-bit, scaled to the
compute dtype, divided by tp under sequence parallelism, cut to the layer
input under full recompute, times the microbatches a schedule keeps in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.spec import JobSpec
from workers.layout import coordinates, stage_ids

OPTIM_BYTES = {"adamw": 8, "adam": 8}


@dataclass
class RankEstimate:
    rank: int
    coords: dict
    stages: list[int]
    params: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes + self.activation_bytes


def stage_params(spec: JobSpec, stage: int, n_stages: int) -> tuple[int, int]:
    """(tensor-parallel-sharded params, replicated params) of one pipeline stage."""
    m = spec.model
    d, f, v = m.d_model, m.ffn_dim, m.vocab_size
    per_layer_sharded = 4 * d * d + 2 * d * f
    per_layer_norms = 2 * d
    layers = m.n_layers // n_stages
    sharded, replicated = layers * per_layer_sharded, layers * per_layer_norms
    if stage == 0:
        sharded += v * d + (m.seq_len * d if m.positions == "learned" else 0)
    if stage == n_stages - 1:
        sharded += d * v
        replicated += d
    return sharded, replicated


def in_flight_microbatches(spec: JobSpec, pp_rank: int) -> int:
    p, mb = spec.parallel, spec.train.microbatches
    if p.pp == 1:
        return 1
    if p.pp_schedule == "gpipe":
        return mb
    return min(mb, p.pp - pp_rank + (p.stages_per_rank - 1) * p.pp)


def activation_bytes(spec: JobSpec, n_layers_here: int, pp_rank: int) -> int:
    m, p = spec.model, spec.parallel
    b = spec.train.global_batch_size // p.dp // spec.train.microbatches
    s, h, a = m.seq_len, m.d_model, m.n_heads
    scale = 2.0 if spec.precision.dtype == "fp32" else 1.0
    if spec.memory.recompute == "full":
        per_layer = 2 * s * b * h * scale
    else:
        attn_core = 5 * a * s * s * b
        per_layer = (34 * s * b * h + (0 if spec.memory.recompute == "selective" else attn_core)) * scale
        if p.tp > 1:
            per_layer /= p.tp if p.sequence_parallel else 1
    return int(per_layer * n_layers_here * in_flight_microbatches(spec, pp_rank))


def estimate(spec: JobSpec) -> list[RankEstimate]:
    p = spec.parallel
    n_stages = p.pp * p.stages_per_rank
    out = []
    for rank in range(p.world_size):
        coords = vars(coordinates(rank, p.dp, p.pp, p.tp))
        ids = stage_ids(coords["pp"], p.pp, p.stages_per_rank, p.pp_schedule)
        params = 0
        for sid in ids:
            sharded, replicated = stage_params(spec, sid, n_stages)
            params += sharded // p.tp + replicated
        optim_per_param = OPTIM_BYTES.get(spec.optim.name, 4 if spec.optim.momentum else 0)
        weights, grads, optim = 4 * params, 4 * params, optim_per_param * params
        if p.zero >= 1:
            optim //= p.dp
        if p.zero >= 2:
            grads //= p.dp
        if p.zero >= 3:
            weights //= p.dp
        layers_here = len(ids) * (spec.model.n_layers // n_stages)
        out.append(RankEstimate(rank, coords, ids, params, weights, grads, optim,
                                activation_bytes(spec, layers_here, coords["pp"])))
    return out


def render(spec: JobSpec) -> str:
    p = spec.parallel
    rows = estimate(spec)
    lines = [
        f"job {spec.name}: dp={p.dp} x pp={p.pp} x tp={p.tp} = {p.world_size} ranks, zero={p.zero}, "
        f"schedule={p.pp_schedule} ({p.stages_per_rank} stage(s)/rank), precision={spec.precision.dtype}, "
        f"recompute={spec.memory.recompute}",
        f"{'rank':>4} {'dp':>3} {'pp':>3} {'tp':>3} {'stages':>8} {'params':>12} {'weights':>10} "
        f"{'grads':>10} {'optim':>10} {'activ':>10} {'total':>10}",
    ]
    for r in rows:
        lines.append(
            f"{r.rank:>4} {r.coords['dp']:>3} {r.coords['pp']:>3} {r.coords['tp']:>3} "
            f"{','.join(map(str, r.stages)):>8} {r.params:>12,} {_mib(r.param_bytes)} {_mib(r.grad_bytes)} "
            f"{_mib(r.optim_bytes)} {_mib(r.activation_bytes)} {_mib(r.total_bytes)}"
        )
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:>8.2f}Mi"
