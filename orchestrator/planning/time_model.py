"""Predicted step time of a layout: compute + exposed communication + pipeline bubble, as pure arithmetic.

Our own (no library predicts a training step): the planner ranks layouts by it. Terms, for one rank:

- compute: the step's model FLOPs on this rank (6·N per token plus attention's 12·L·h·s, PaLM's
  accounting; full recompute runs the forward twice, 8·N; selective recomputes the attention core)
  over ``peak · efficiency``;
- bubble: a pipeline idles (p-1)/(v·m) of its compute (``bubble.theoretical_bubble``'s ratio of idle to busy);
- exposed communication, per mesh dimension, bytes (``comm_model``) over the bandwidth of the link the
  dimension's groups cross: NVLink inside a node, the per-GPU InfiniBand share between nodes (ranks are
  laid out TP innermost, then CP, PP, DP outermost; an expert group where placement packs it: ``expert_link``).
  TP, CP and EP's all-to-alls sit on the critical path (counted whole);
  pipeline sends overlap the steady state, so only the fill and drain path of p-1 hops shows; the
  gradient reduction overlaps the last microbatch's backward (2/3 of its compute) and ZeRO's parameter
  gathers are prefetched under the whole step's compute.

Defaults per GPU type (``GPUS``): dense bf16 peak (vendor data sheets), memory, NVLink bandwidth per
direction (A100 600 GB/s, H100/H200 900 GB/s bidirectional) and the node's InfiniBand per GPU (DGX A100:
8 x 200 Gb/s, DGX H100: 8 x 400 Gb/s). ``plan.efficiency`` (default 0.5: Megatron's 1T run reached 52% of
A100 peak, Llama 3 405B 38-43% of H100's) scales the peak; every figure can be overridden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense bf16, FLOP/s
    memory: int  # bytes
    intra_bw: float  # bytes/s per direction between GPUs of one node (NVLink)
    inter_bw: float  # bytes/s per GPU between nodes (its InfiniBand share)
    gpus_per_node: int = 8

    def with_overrides(self, **fields) -> GPU:
        """Copy with the fields given (``None`` keeps the default)."""
        return replace(self, **{k: v for k, v in fields.items() if v is not None})


GPUS = {
    "A100": GPU("A100", 312e12, 80 * 10**9, 300e9, 25e9),
    "H100": GPU("H100", 989e12, 80 * 10**9, 450e9, 50e9),
    "H200": GPU("H200", 989e12, 141 * 10**9, 450e9, 50e9),
    "H800": GPU("H800", 989e12, 80 * 10**9, 200e9, 50e9),  # an H100 with NVLink cut to 400 GB/s (DeepSeek-V3's)
}
DEFAULT_EFFICIENCY = 0.5


def gpu(name: str) -> GPU:
    key = name.upper()
    if key not in GPUS:
        raise ValueError(f"unknown GPU type {name!r}; known: {sorted(GPUS)} (or give --peak-tflops and bandwidths)")
    return GPUS[key]


def link_bandwidth(g: GPU, inner: int, degree: int) -> float:
    """Bandwidth of a dimension whose peers are ``inner`` ranks apart and ``degree`` wide: NVLink while the
    group fits inside a node, else the inter-node share (the ring's slowest hop)."""
    return g.intra_bw if inner * degree <= g.gpus_per_node else g.inter_bw


@dataclass(frozen=True)
class StepTime:
    compute: float
    bubble: float
    exposed: dict[str, float]  # per mesh dimension

    @property
    def total(self) -> float:
        return self.compute + self.bubble + sum(self.exposed.values())

    def as_dict(self) -> dict:
        return {"compute_s": self.compute, "bubble_s": self.bubble,
                **{f"{k}_s": v for k, v in self.exposed.items()}, "step_s": self.total}


def flops_per_token(params: float, n_layers: int, d_model: int, seq: int, recompute: str = "none") -> float:
    """Hardware FLOPs per token: 6·N + 12·L·h·s, plus the second forward that recompute runs
    (2·N + 4·L·h·s for full; the attention core's 4·L·h·s for selective)."""
    attention = 12.0 * n_layers * d_model * seq
    extra = {"none": 0.0, "selective": attention / 3, "full": 2.0 * params + attention / 3}[recompute]
    return 6.0 * params + attention + extra


def step_time(flops: float, bytes_by_dim: dict[str, float], g: GPU, degrees: dict[str, int], microbatches: int,
              virtual_stages: int = 1, efficiency: float = DEFAULT_EFFICIENCY, gather_bytes: float = 0.0,
              boundary_bytes: float = 0.0) -> StepTime:
    """``flops``: this rank's FLOPs for the step; ``bytes_by_dim``: ``comm_model.step_bytes``; ``degrees``:
    dp/pp/cp/tp; ``gather_bytes``: the part of dp's bytes that are ZeRO parameter gathers (prefetched);
    ``boundary_bytes``: one microbatch's pipeline send."""
    compute = flops / (g.peak_flops * efficiency)
    pp, m = degrees.get("pp", 1), microbatches
    bubble = compute * (pp - 1) / (virtual_stages * m)
    tp, cp = degrees.get("tp", 1), degrees.get("cp", 1)
    bw = {"tp": link_bandwidth(g, 1, tp), "cp": link_bandwidth(g, tp, cp),
          "pp": link_bandwidth(g, tp * cp, pp), "ep": expert_link(g, tp, cp, degrees.get("ep", 1)),
          **data_parallel_links(g, tp * cp * pp, degrees.get("dp", 1), degrees.get("dp_shard"))}
    exposed = {
        "tp": bytes_by_dim.get("tp", 0.0) / bw["tp"],
        "cp": bytes_by_dim.get("cp", 0.0) / bw["cp"],
        "ep": bytes_by_dim.get("ep", 0.0) / bw["ep"],
        "pp": 2 * (pp - 1) * boundary_bytes / bw["pp"],
    }
    shard = "dp_shard" if "dp_shard" in bytes_by_dim else "dp"  # ZeRO's own collectives: over all dp, or a group
    reduce = (bytes_by_dim.get(shard, 0.0) - gather_bytes) / bw[shard]
    reduce += bytes_by_dim.get("dp_replicate", 0.0) / bw["dp_replicate"] if shard == "dp_shard" else 0.0
    exposed["dp"] = max(0.0, reduce - compute * 2 / 3 / m) + max(0.0, gather_bytes / bw[shard] - compute)
    return StepTime(compute, bubble, exposed)


def expert_link(g: GPU, tp: int, cp: int, ep: int) -> float:
    """Bandwidth of an expert group's all-to-all. Its ranks share a stage and a tp index and differ in their
    data (and cp) index, and placement fills the nodes with runs of lcm(ep, cp) / cp data indices stage by stage
    (``orchestrator.runtime.node_order.fill_order``): tp x lcm(ep, cp) ranks, so the group stays on NVLink while
    those fit in a node."""
    return g.intra_bw if tp * math.lcm(ep, cp) <= g.gpus_per_node else g.inter_bw


def data_parallel_links(g: GPU, inner: int, dp: int, dp_shard: int | None) -> dict[str, float]:
    """Bandwidth of the dp row, or under hybrid sharding of its shard groups (the ``dp_shard`` nearest dp ranks,
    NVLink while they fit in a node) and of the replicas of a shard (``dp / dp_shard`` ranks, ``dp_shard``
    replicas apart: the inter-node links once a shard group fills a node)."""
    if dp_shard is None or dp_shard >= dp:
        return {"dp": link_bandwidth(g, inner, dp)}
    return {"dp_shard": link_bandwidth(g, inner, dp_shard),
            "dp_replicate": link_bandwidth(g, inner * dp_shard, dp // dp_shard)}
