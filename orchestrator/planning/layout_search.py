"""Search dp × tp × pp × cp × ZeRO × micro-batch × recompute × schedule for the fastest layout that fits.

Why a second path beside ``estimate``: that one reads a validated ``JobSpec`` (LoRA, offload, NF4) and takes
milliseconds a rank, and a spec refuses layer counts that do not divide the stages. The search needs
thousands of candidates in well under a second, uneven stage splits (Llama 3 405B: 126 layers on 16 stages)
and context parallelism as a formula, so it works on plain numbers (``Shape``) through the same functions
(``memory_model``: state, activations, in-flight microbatches, the rank's terms ``estimate`` derives its own from:
saved bytes and heads, gradients carried, activations freed first, pipeline edges, tp's embedding gradient, and
the in-step peak; ``comm_model``; ``time_model``). ``tests/unit/test_layout_search.py`` checks that it equals
``estimate`` wherever both apply.

Identical ranks are estimated once: every dp/tp/cp peer of a pipeline rank holds the same bytes, and of the
pipeline ranks only three classes can hold the peak (the first: embedding and the most microbatches in
flight; the second: the first of the middle stages, which take the split's extra layers; the last: the
head), so a candidate costs at most three rank estimates whatever the GPU count (one per pp rank on a split of
the planner's own).

Stage splits (``units``, the layout picker's): each pipelined layout is also priced on the split of
``pp_split: auto``'s program (``balanced_layers``), and one that does not fit on the fastest split that does
(``Evaluator.fitting_split``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields, replace
from itertools import product
from typing import NamedTuple

from orchestrator.planning import comm_model as cm
from orchestrator.planning import memory_model as mm
from orchestrator.planning import moe_terms
from orchestrator.planning import time_model as tm
from orchestrator.planning.moe_terms import FFN_MATRICES
from orchestrator.spec.sections import recompute_plan
from orchestrator.units import human_bytes
from workers.contract.mixed_precision import planned_fsdp_mixed
from workers.contract.param_gather import wire_bytes_per_value
from workers.contract.schedules import schedule as schedule_facts
from workers.parallel.layout import stage_ids
from workers.parallel.partition import balanced_split

TP_MAX = 8
RECOMPUTE = ("none", "selective", "full")
_STATE_FIELDS = tuple(f.name for f in fields(mm.ModelState))  # summed field by field (``astuple`` deep-copies)


def planned_on_gpu(spec) -> bool:
    """Whether the ranks run on GPUs, as the planner assumes (``parallel.device: auto`` is planned as one)."""
    return spec.parallel.device != "cpu"


def planned_compiled_loss(spec) -> bool:
    """Whether the whole-logits loss runs through ``torch.compile`` (``train.compile``; DPO's loss is its own,
    never compiled): ``memory_model.loss_backward_bytes``'s ``compiled``."""
    return spec.train.compile and spec.train.objective != "dpo"


def attention_params(m) -> int | None:
    """One attention's parameters where they are no plain q, k, v, o: DeepSeek-V3's MLA, gpt-oss's (biases and
    sinks); None otherwise."""
    return {"deepseek_v3": m.mla_params, "gpt_oss": m.gpt_oss_attention_params}.get(m.arch)


@dataclass(frozen=True)
class Moe:
    """A model's MoE blocks in plain numbers (``moe_terms.moe_params``' terms): which blocks have them, what one
    holds, and what one saves and buffers per micro-batch size (``moe_terms.moe_activation_bytes``,
    ``all_to_all_bytes``), so the search prices expert parallelism as the estimate does without a spec."""

    experts: int
    top_k: int
    expert_params: int  # one MoE block's routed experts, all of them: what ep splits
    replicated: int  # its router and shared experts, whole on every tp rank
    dense_ffn: int  # the dense feed-forward an MoE block replaces (tp-sharded in a dense block)
    dense_first: int = 0  # DeepSeek-V3's first blocks keep the dense feed-forward
    every: int = 1  # every ``every``-th block from block ``every - 1`` (``ModelConfig.is_moe_layer``)
    by_mbs: tuple[tuple[int, int, int], ...] = ()  # (micro-batch, one MoE feed-forward's saved bytes, all-to-all)

    def count(self, start: int, stop: int) -> int:
        """MoE blocks among global blocks ``start`` .. ``stop - 1``."""
        lo = max(start, self.dense_first)
        return stop // self.every - lo // self.every if stop > lo else 0

    def per_mbs(self, micro_batch: int) -> tuple[int, int]:
        """(saved bytes of one MoE feed-forward, all-to-all buffers) for one microbatch of ``micro_batch``."""
        return next((saved, a2a) for mbs, saved, a2a in self.by_mbs if mbs == micro_batch)

    @property
    def active(self) -> int:
        """Parameters one token computes with in an MoE block's feed-forward: router, shared and k experts."""
        return self.replicated + self.top_k * self.expert_params // self.experts

    @classmethod
    def of(cls, spec) -> Moe | None:
        """The job's MoE blocks, or None for a dense model."""
        m, moe = spec.model, spec.model.moe
        first = next((i for i in range(m.n_layers) if m.is_moe_layer(i)), None)
        if moe is None or first is None:
            return None
        dense, replicated, experts = moe_terms.moe_params(spec, first)
        batch = spec.train.global_batch_size  # a micro-batch is global / (dp x microbatches): one of its divisors
        sizes = [b for b in range(1, batch + 1) if batch % b == 0]
        by_mbs = tuple((b, moe_terms.moe_activation_bytes(spec, b), moe_terms.all_to_all_bytes(spec, b)) for b in sizes)
        return cls(moe.experts, moe.k, experts, replicated, dense, m.dense_layers if m.arch == "deepseek_v3" else 0,
                   1 if m.arch == "deepseek_v3" else moe.every, by_mbs)


@functools.lru_cache(maxsize=4096)
def stage_moe_blocks(moe: Moe, counts: tuple[int, ...]) -> tuple[int, ...]:
    """MoE blocks per stage of a split (``counts``: layers per stage)."""
    out, start = [], 0
    for n in counts:
        out.append(moe.count(start, start + n))
        start += n
    return tuple(out)


@dataclass(frozen=True)
class Shape:
    """A transformer and its batch, in plain numbers."""

    n_layers: int
    d_model: int
    n_heads: int
    ffn_dim: int
    vocab: int
    seq: int
    global_batch: int  # sequences per step
    kv_heads: int | None = None
    arch: str = "llama"
    tied: bool = False
    learned_positions: bool = False
    compute_bytes: int = 2  # bf16 under autocast (raymesh keeps fp32 state either way)
    # the job's layouts with ZeRO-2/3 would run bf16 through FSDP2's mixed-precision policy
    # (workers.contract.mixed_precision: bf16 with precision.policy fsdp, or auto on a GPU)
    fsdp_policy: bool = False
    reduce_bytes: int = 4  # gradient reduction width under that policy (precision.reduce_dtype)
    fsdp_prefetch: int = 0  # parallel.fsdp_prefetch: ZeRO-3 blocks gathered ahead (FSDP2's one when 0)
    cp_impl: str = "ring"  # parallel.cp_impl: the kernel's buffers, and allgather's saved K/V
    document_mask: bool = False  # model.attention_mask: document: each microbatch's saved mask
    head_dim: int | None = None  # model.head_dim (Qwen3's wider heads); None: d_model / n_heads
    qkv_bias: bool = False  # model.qkv_bias: Qwen2's q/k/v biases, sharded with their columns
    qk_norm: bool = False  # model.qk_norm: Qwen3's two per-head norm weights, replicated
    loss_chunks: int = 1  # train.loss_chunks: the head's logits one chunk of tokens at a time
    gpu: bool = True  # parallel.device is not cpu: eager norms are one fused kernel (memory_model's fused_norm)
    compiled: bool = False  # train.compile: the blocks through inductor
    compiled_loss: bool = False  # and the whole-logits loss too (not DPO's own loss)
    grad_reduce_bytes: int = 4  # parallel.grad_reduce_dtype: ZeRO 1-3's gradient reduction width outside the policy
    attention_params: int | None = None  # DeepSeek-V3's MLA (``ModelConfig.mla_params``); None: q, k, v, o
    param_gather_bytes: float = 4  # parallel.param_gather_dtype: ZeRO 1-3's parameter all-gather, bytes per value
    moe: Moe | None = None  # the MoE blocks (model.moe); None: dense

    @classmethod
    def of(cls, spec) -> Shape:
        m = spec.model
        return cls(m.n_layers, m.d_model, m.n_heads, m.ffn_dim, spec.padded_vocab_size, m.seq_len,
                   spec.train.global_batch_size, m.kv_heads, m.arch, m.tie_embeddings, m.positions == "learned",
                   mm.BYTES_PER[spec.precision.dtype], planned_fsdp_mixed(
                       spec.precision.dtype, spec.precision.policy, 3, spec.parallel.dp_sync, spec.parallel.device),
                   mm.BYTES_PER[spec.precision.reduce_dtype], spec.parallel.fsdp_prefetch, spec.parallel.cp_impl,
                   m.attention_mask == "document", m.head_dim, m.qkv_bias, m.qk_norm,
                   spec.train.loss_chunks, planned_on_gpu(spec), spec.train.compile, planned_compiled_loss(spec),
                   mm.BYTES_PER[spec.parallel.grad_reduce_dtype], attention_params(m),
                   wire_bytes_per_value(spec.parallel.param_gather_dtype), Moe.of(spec))

    def fsdp_mixed(self, zero: int) -> bool:
        """Whether a layout with ``zero`` computes through FSDP2's mixed-precision policy (FSDP2 units needed)."""
        return self.fsdp_policy and zero >= 2

    def boundary_width(self, zero: int) -> int:
        """Bytes per element of the hidden state a pipeline stage sends: fp32 under autocast (the residual
        stream stays fp32), the compute width under FSDP2's policy."""
        return self.compute_bytes if self.fsdp_mixed(zero) else 4

    @property
    def kv(self) -> int:
        return self.kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """Each head's width (``ModelConfig.head_size``)."""
        return self.head_dim or self.d_model // self.n_heads

    @functools.cached_property
    def block_params(self) -> int:
        """TP-sharded parameters of one block: q, o (h x n_heads·head_dim), k, v (h x kv·head_dim), q/k/v biases
        under ``qkv_bias``, the FFN's matrices."""
        d, q, kv = self.d_model, self.n_heads * self.head_size, self.kv * self.head_size
        bias = q + 2 * kv if self.qkv_bias else 0
        attention = self.attention_params if self.attention_params is not None else 2 * d * q + 2 * d * kv + bias
        return attention + FFN_MATRICES[self.arch] * d * self.ffn_dim

    @property
    def block_replicated(self) -> int:
        """Parameters of one block every tp rank holds whole: the two norms, Qwen3's q/k norms (``qk_norm``)."""
        return 2 * self.d_model + (2 * self.head_size if self.qk_norm else 0)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.d_model + (self.seq * self.d_model if self.learned_positions else 0)

    @property
    def head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.d_model

    @property
    def params(self) -> int:
        d = self.d_model
        blocks = self.n_layers * (self.block_params + self.block_replicated)
        return blocks + self.embedding_params + self.head_params + d


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    cp: int = 1
    zero: int = 0
    micro_batch: int = 1
    recompute: str = "none"
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    split: tuple[int, ...] | None = None  # layers per stage; None: ``split_layers`` (even where they divide)
    dp_shard: int | None = None  # hybrid sharding: ZeRO shards inside groups of this many dp ranks (None: all dp)
    ep: int = 1  # expert parallelism: each MoE block's routed experts split over ep of the dp x cp ranks

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shards(self) -> int:
        """Ranks ZeRO shards over: dp x cp, as the workers' ``data_parallel_mesh`` (cp ranks hold the same
        weights), so dp=1 cp=8 shards eight ways and replicates under ZeRO-0; under hybrid sharding dp_shard x cp
        (``process_group.shard_mesh``)."""
        return (self.dp_shard or self.dp) * self.cp

    def microbatches(self, shape: Shape) -> int:
        return shape.global_batch // (self.dp * self.micro_batch)

    def label(self) -> str:
        sched = f" {self.schedule}x{self.stages_per_rank}" if self.pp > 1 else ""
        sched += f" dp_shard={self.dp_shard}" if self.dp_shard else ""
        sched += f" ep={self.ep}" if self.ep > 1 else ""
        split = f" split={','.join(map(str, self.split))}" if self.split else ""
        return (f"dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp} zero={self.zero} mbs={self.micro_batch} "
                f"recompute={self.recompute}{sched}{split}")

    def stage_layers(self, n_layers: int) -> tuple[int, ...]:
        """Layers per stage: ``split``, else ``split_layers``'s."""
        return self.split or split_layers(n_layers, self.pp * self.stages_per_rank)

    @functools.cached_property
    def unsplit(self) -> Layout:
        """This layout on the default split: what its splits share (kept: ``replace`` costs microseconds, and the
        search asks once per rank)."""
        return self if self.split is None else replace(self, split=None)


@functools.lru_cache(maxsize=4096)
def split_layers(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """Layers per stage, as even as possible; the extra layers go to the middle stages first, so the
    first (embedding) and last (head) stages stay light, as Llama 3 split 126 layers over 16 stages."""
    base, extra = divmod(n_layers, n_stages)
    counts = [base] * n_stages
    order = [*range(1, n_stages - 1), 0, n_stages - 1] if n_stages > 2 else list(range(n_stages))
    for stage in order[:extra]:
        counts[stage] += 1
    return tuple(counts)


@dataclass(frozen=True)
class UnitTimes:
    """Relative costs of the units a stage cut moves (``orchestrator.planning.stage_split.unit_times``): the
    embedding (first stage), each block, the head (last stage)."""

    first: float
    layers: tuple[float, ...]
    last: float


@functools.lru_cache(maxsize=256)
def balanced_layers(units: UnitTimes, n_stages: int) -> tuple[int, ...]:
    """PipeDream's program over ``units`` (``pp_split: auto``'s): the split whose slowest stage is fastest."""
    return balanced_split(units.layers, n_stages, units.first, units.last)


@functools.lru_cache(maxsize=1024)
def capped_layers(units: UnitTimes, caps: tuple[int, ...]) -> tuple[int, ...]:
    """``balanced_layers`` with stage ``s`` holding at most ``caps[s]`` layers (``Evaluator.fitting_split``),
    cached: layouts share caps (for Llama 3 405B on 16,384 GPUs 293 programs ask for 58 cap lists), and a
    program over 126 layers costs milliseconds."""
    return balanced_split(units.layers, len(caps), units.first, units.last, max_layers=caps)


@dataclass
class Candidate:
    layout: Layout
    peak: int  # bytes, the largest rank class
    peak_pp_rank: int
    time: tm.StepTime
    bytes_by_dim: dict[str, float]

    @property
    def step_s(self) -> float:
        return self.time.total


@dataclass
class SearchResult:
    best: list[Candidate]  # fitting candidates, fastest first
    too_big: list[Candidate]  # the smallest of those that do not fit
    limit: int
    rank_estimates: int = 0  # distinct rank estimates computed (identical ranks once)
    considered: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


class Place(NamedTuple):
    """What a pp rank's peak reads of the pipeline schedule (``pipeline_places``)."""

    ids: tuple[int, ...]  # the rank's stages
    first: bool  # it holds the first stage (the embedding)
    last: bool  # it holds the last stage (the head)
    in_flight: int  # ``memory_model.in_flight_microbatches``
    heads: int  # ``memory_model.head_copies``
    carried: bool  # ``memory_model.carries_grads``
    edges: int  # ``memory_model.pipeline_edges``


@functools.lru_cache(maxsize=4096)
def pipeline_places(pp: int, stages_per_rank: int, schedule: str, microbatches: int) -> tuple[Place, ...]:
    """Each pp rank's place, cached: every layout of the same pipeline (ZeRO stages, recompute policies, tp and
    cp degrees, stage splits) shares them."""
    n_stages, out = pp * stages_per_rank, []
    for pp_rank in range(pp):
        ids = tuple(stage_ids(pp_rank, pp, stages_per_rank, schedule))
        last = n_stages - 1 in ids
        in_flight = mm.in_flight_microbatches(schedule, pp, pp_rank, microbatches, len(ids))
        out.append(Place(ids, 0 in ids, last, in_flight,
                         mm.head_copies(last, pp > 1, schedule_facts(schedule).all_forwards_first, microbatches),
                         mm.carries_grads(pp > 1, in_flight, microbatches, len(ids)),
                         mm.pipeline_edges(list(ids), n_stages)))
    return tuple(out)


class Ends(NamedTuple):
    """What holding the first stage (the embedding) or the last (the head) adds to a rank's peak
    (``LayoutPeaks.ends``)."""

    root: int  # embedding and head parameters
    last_norm: int  # the final norm's weight
    zero3_gathered: int  # ``memory_model.zero3_gathered_params``
    tp_embedding_grads: int  # ``memory_model.tp_embedding_grad_bytes`` where the rank has them, else 0
    embedding: int  # the embedding's saved bytes
    head_freed: int  # what backward frees first outside a pipeline: the head
    loss: int  # ``memory_model.loss_backward_bytes``


class LayoutPeaks:
    """The in-step peak of each pp rank of one layout (its stage split aside) as a function of the rank's layer
    count: ``estimate.RankEstimate.total_bytes`` on plain numbers.

    Why: the search asks for ~185,000 rank peaks for Llama 3 405B on 16,384 GPUs (every pp rank of a split
    layout; ``Evaluator.max_layers``'s binary search at every pp rank), and derived afresh from shape and layout
    each time they took most of the search's time. So the terms the whole layout shares are worked out once,
    those a rank's place in the pipeline sets once per pipeline (``pipeline_places``), what the first and last
    stage add once per layout, and model state once per parameter count (ranks holding as many layers hold as
    many parameters)."""

    def __init__(self, shape: Shape, layout: Layout):
        s, lay = shape, layout
        self.shape, self.layout, self.microbatches = s, lay, lay.microbatches(s)
        self.places = pipeline_places(lay.pp, lay.stages_per_rank, lay.schedule, self.microbatches)
        self.tp, self.pipelined = lay.tp, lay.pp > 1
        self.block_params, self.norms = s.block_params, 2 * s.d_model  # a block: tp-sharded, its two norms
        mixed = s.fsdp_mixed(lay.zero)
        self.seq, c, sp = s.seq // lay.cp, s.compute_bytes, lay.tp > 1
        self.precision = "fsdp_mixed" if mixed else "autocast" if c < 4 else "fp32"
        self.layer = _layer_bytes(s, self.seq, lay.micro_batch, lay.tp, lay.recompute, mixed, lay.cp)
        self.head = mm.head_activation_bytes(self.seq, lay.micro_batch, s.d_model, s.vocab, lay.tp, sp, c,
                                             fsdp_mixed=mixed, loss_chunks=s.loss_chunks,
                                             fused_norm=s.gpu and not s.compiled)
        self.mask = 0  # one document mask per microbatch and stage, shared by the blocks
        if s.document_mask and lay.recompute == "none":
            self.mask = mm.document_mask_bytes(s.seq, lay.micro_batch, lay.cp, s.cp_impl, c)
        self.working = 0  # full recompute's rebuilt block
        if lay.recompute == "full":
            self.working = _layer_bytes(s, self.seq, lay.micro_batch, lay.tp, "none", mixed)
        hidden = s.boundary_width(lay.zero) * self.seq * lay.micro_batch * s.d_model // (lay.tp if sp else 1)
        self.edge = self.microbatches * hidden  # a pipeline receive buffer per microbatch
        self.cp_kernel = mm.cp_buffer_bytes(s.cp_impl, s.seq, lay.micro_batch, s.d_model, s.n_heads, s.kv, lay.cp,
                                            lay.tp, c, s.head_size)
        self.regathers = lay.zero >= 3 and lay.shards > 1
        self.autocast_width = c if c < 4 and not mixed else 0  # autocast's 16-bit copy of each weight
        self.moe_layer = self.moe_working = self.all_to_all = 0
        if s.moe is not None:
            self._add_moe(s.moe, mixed)
        self._ends: dict[tuple[bool, bool], Ends] = {}
        self._states: dict[tuple[int, int, int, int], mm.ModelState] = {}

    def _add_moe(self, moe: Moe, mixed: bool) -> None:
        """An MoE block's saved bytes and full recompute's rebuilt one (``estimate.layer_bytes``: the dense
        feed-forward's input copies out, the MoE layer's tensors in) and, at ep > 1, the all-to-all's buffers."""
        s, lay = self.shape, self.layout
        saved, a2a = moe.per_mbs(lay.micro_batch)
        inputs = s.compute_bytes * self.seq * lay.micro_batch * s.d_model * mm.feed_forward_copies(
            s.arch, s.compute_bytes, None, mixed)
        rebuilt = _layer_bytes(s, self.seq, lay.micro_batch, lay.tp, "none", mixed, moe=True) + saved - inputs
        self.moe_layer = (_layer_bytes(s, self.seq, lay.micro_batch, lay.tp, lay.recompute, mixed, lay.cp, True)
                          + (saved - inputs if lay.recompute != "full" else 0))
        self.moe_working = rebuilt if lay.recompute == "full" else 0
        self.all_to_all = a2a if lay.ep > 1 else 0

    def _add_ends(self, first: bool, last: bool) -> Ends:
        """What a rank holding the first and/or the last stage adds (``peak`` asks on first use, then reads
        ``_ends``)."""
        s, lay = self.shape, self.layout
        root = s.embedding_params * first + s.head_params * last  # a tied head is the embedding (one stage)
        tp_grads = 0
        if first and lay.tp > 1 and lay.zero < 2:
            tp_grads = mm.tp_embedding_grad_bytes(s.vocab, s.d_model, lay.tp)
        loss = 0
        if last:
            loss = mm.loss_backward_bytes(self.seq, lay.micro_batch, s.vocab, s.loss_chunks,
                                          4 * s.vocab * s.d_model // lay.tp, s.compiled_loss)
        ends = self._ends[first, last] = Ends(
            root, s.d_model * last, mm.zero3_gathered_params(root, s.block_params, lay.tp, s.fsdp_prefetch),
            tp_grads, mm.embedding_activation_bytes(self.seq, lay.micro_batch) * first, self.head * last, loss)
        return ends

    def peak(self, pp_rank: int, layers: int, moe: int = 0) -> int:
        """In-step peak bytes of pipeline rank ``pp_rank`` holding ``layers`` layers, ``moe`` of them MoE blocks
        (their routed experts split over ep: ``estimate.estimate_rank``'s ``experts``)."""
        at, m = self.places[pp_rank], self.shape.moe
        end = self._ends.get((at.first, at.last)) or self._add_ends(at.first, at.last)
        sharded, replicated, experts = layers * self.block_params + end.root, 0, 0
        if moe:  # an MoE block's feed-forward: router and shared experts whole on every tp rank, experts over ep
            sharded, replicated = sharded - moe * m.dense_ffn, moe * m.replicated
            experts = moe * m.expert_params // self.layout.ep
        params = sharded // self.tp + layers * self.norms + end.last_norm + replicated
        key = (params + experts, experts, end.zero3_gathered, end.tp_embedding_grads)
        state = self._states.get(key) or self._add_state(*key)
        chunks = (layers - moe) * self.layer + moe * self.moe_layer + end.embedding
        chunks += len(at.ids) * self.mask if layers else 0
        saved = mm.rank_saved_bytes(chunks, len(at.ids), at.in_flight, self.head, at.heads)
        freed = mm.freed_first(saved, at.in_flight, self.pipelined, end.head_freed)
        working = max(self.working if layers > moe else 0, self.moe_working if moe else 0)
        return (mm.in_step_peak(state, saved, at.carried, self.regathers, freed, working, end.loss)
                + self.autocast_width * (params + experts) + self.edge * at.edges + self.cp_kernel + self.all_to_all)

    def _add_state(self, params: int, experts: int, zero3_gathered: int, tp_embedding_grads: int) -> mm.ModelState:
        """``memory_model.model_state`` of a rank holding ``params``, ``experts`` of them routed experts: reduced
        and ZeRO-sharded over the dp x cp / ep ranks holding the same ones (``estimate.rank_model_state``).
        ``peak`` asks once per distinct argument, then reads ``_states``."""
        lay = self.layout
        steps = {"accumulating": self.microbatches > 1 or self.pipelined, "pipelined": self.pipelined}
        state = mm.model_state(params - experts, lay.shards, lay.zero, self.precision, "adamw", fsdp=True,
                               zero3_gathered_params=zero3_gathered, **steps)
        if experts:
            own = mm.model_state(experts, lay.dp * lay.cp // lay.ep, lay.zero, self.precision, "adamw", fsdp=True,
                                 zero3_gathered_params=self.shape.moe.expert_params // lay.ep, **steps)
            state = mm.ModelState(*(getattr(state, k) + getattr(own, k) for k in _STATE_FIELDS))
        if tp_embedding_grads:
            state = replace(state, grads=state.grads + tp_embedding_grads)
        self._states[params, experts, zero3_gathered, tp_embedding_grads] = state
        return state


class Evaluator:
    """Memory and time of candidates of one shape on one GPU type; counts the rank estimates it makes."""

    def __init__(self, shape: Shape, g: tm.GPU, efficiency: float = tm.DEFAULT_EFFICIENCY):
        self.shape, self.gpu, self.efficiency = shape, g, efficiency
        self.rank_estimates = 0
        self._peaks: LayoutPeaks | None = None

    def rank_classes(self, layout: Layout) -> list[int]:
        """The pp ranks that can hold the peak or the most compute: three classes under ``split_layers``; every
        rank under a split of the planner's own (which layers a rank holds and how many microbatches it keeps
        in flight both vary by rank, and their product does not peak at a rank one can name up front)."""
        if layout.split is not None:
            return list(range(layout.pp))
        return sorted({0, min(1, layout.pp - 1), layout.pp - 1})

    def stage_layers(self, layout: Layout) -> tuple[int, ...]:
        return layout.stage_layers(self.shape.n_layers)

    def layout_peaks(self, layout: Layout) -> LayoutPeaks:
        """The peaks of ``layout``'s ranks, shared by its stage splits (the even one, the program's, the one that
        fits). The search prices those one after another, so only the latest layout's are kept: thousands kept
        cost the garbage collector more than they saved (a fifth of Megatron 1T's search)."""
        key = layout.unsplit
        if self._peaks is None or self._peaks.layout != key:
            self._peaks = LayoutPeaks(self.shape, key)
        return self._peaks

    def rank_peak(self, layout: Layout, pp_rank: int) -> int:
        """In-step peak bytes of one rank of pipeline rank ``pp_rank`` (``estimate.RankEstimate.total_bytes``
        on plain numbers)."""
        return self._rank_peak(self.layout_peaks(layout), self.stage_layers(layout), pp_rank)

    def _rank_peak(self, peaks: LayoutPeaks, counts: tuple[int, ...], pp_rank: int) -> int:
        ids = peaks.places[pp_rank].ids
        moe = sum(map(stage_moe_blocks(self.shape.moe, counts).__getitem__, ids)) if self.shape.moe else 0
        return self._estimate(peaks, pp_rank, sum(map(counts.__getitem__, ids)), moe)

    def _estimate(self, peaks: LayoutPeaks, pp_rank: int, layers: int, moe: int = 0) -> int:
        """``peaks.peak(pp_rank, layers, moe)``, counted as one rank estimate (``SearchResult.rank_estimates``)."""
        self.rank_estimates += 1
        return peaks.peak(pp_rank, layers, moe)

    def fitting_split(self, layout: Layout, units: UnitTimes, limit: int) -> tuple[int, ...] | None:
        """The split whose slowest stage (by ``units``) is fastest among those where every pp rank's in-step peak
        stays within ``limit``, or None when none does: PipeDream's program, each stage capped at the most layers
        its rank holds within ``limit`` (``max_layers``). One stage per rank only (a cap per stage)."""
        if layout.stages_per_rank != 1 or layout.pp > self.shape.n_layers:
            return None
        n, pp, peaks = self.shape.n_layers, layout.pp, self.layout_peaks(layout)
        if not any(self.rank_fits(peaks, stage, -(-n // pp), limit) for stage in range(pp)):
            return None  # some stage holds at least n / pp layers: most layouts that do not fit end here
        caps = tuple(self.max_layers(peaks, stage, limit) for stage in range(pp))
        if sum(caps) < n or min(caps) < 1:
            return None
        return capped_layers(units, caps)

    def max_layers(self, peaks: LayoutPeaks, stage: int, limit: int) -> int:
        """The most layers pp rank ``stage`` (one stage per rank) holds with its peak within ``limit``, 0 if not
        one: a binary search, as a rank's peak grows with its layers (a rank's peak reads its own count only)."""
        lo, hi = 0, self.shape.n_layers - peaks.layout.pp + 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.rank_fits(peaks, stage, mid, limit) else (lo, mid - 1)
        return lo

    def rank_fits(self, peaks: LayoutPeaks, stage: int, layers: int, limit: int) -> bool:
        """Whether pp rank ``stage`` (one stage per rank) holding ``layers`` layers, every other stage one, peaks
        within ``limit``."""
        others = len(peaks.places[stage].ids) - 1  # the rank's own other stages (a V schedule's): one layer each
        held, moe = layers + others, self.shape.moe
        if moe is None:
            return self._estimate(peaks, stage, held) <= limit
        # which blocks the stage gets is not known yet: the fewest and the most MoE blocks it could hold bound
        # its peak (each term grows or shrinks linearly with the MoE count, and the peak is a max of sums)
        n, n_moe = self.shape.n_layers, moe.count(0, self.shape.n_layers)
        return all(self._estimate(peaks, stage, held, k) <= limit
                   for k in {max(0, held - (n - n_moe)), min(held, n_moe)})

    def peak(self, layout: Layout) -> tuple[int, int]:
        """(bytes, pp rank) of the largest rank class."""
        peaks, counts = self.layout_peaks(layout), self.stage_layers(layout)
        return max((self._rank_peak(peaks, counts, r), r) for r in self.rank_classes(layout))

    def step_time(self, layout: Layout) -> tuple[tm.StepTime, dict[str, float]]:
        """The slowest pipeline rank's time: the heaviest stage's FLOPs sets the pace of every stage."""
        s, lay = self.shape, layout
        m = lay.microbatches(s)
        counts, places = self.stage_layers(lay), pipeline_places(lay.pp, lay.stages_per_rank, lay.schedule, m)
        tokens = s.global_batch * s.seq / (lay.dp * lay.cp)
        by_load: dict[tuple[int, int, bool], float] = {}  # a rank's FLOPs by its layers and head: most are alike
        per_rank = []
        for r in self.rank_classes(lay):
            ids = places[r].ids
            moe = sum(map(stage_moe_blocks(s.moe, counts).__getitem__, ids)) if s.moe else 0
            load = (sum(map(counts.__getitem__, ids)), moe, places[r].last)
            if load not in by_load:
                by_load[load] = rank_flops(s, lay, *load) * tokens
            per_rank.append((by_load[load], r))
        flops, r = max(per_rank)
        shape = comm_shape(s, lay, r)
        by_dim = cm.step_bytes(shape, lay.dp, lay.tp, lay.pp, lay.cp, lay.ep, lay.zero, m, lay.dp_shard)
        zero_row = by_dim.get("dp_shard", by_dim.get("dp", 0.0))  # ZeRO's own collectives (hybrid: a shard group's)
        gathers = (zero_row - cm.reduce_scatter(shape.grad_bytes, lay.shards)  # ZeRO-2/3: the rest are gathers
                   - cm.reduce_scatter(shape.expert_grad_bytes, lay.dp * lay.cp // lay.ep))
        degrees = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "dp_shard": lay.dp_shard, "ep": lay.ep}
        time = tm.step_time(flops, by_dim, self.gpu, degrees, m, lay.stages_per_rank, self.efficiency,
                            gather_bytes=max(0.0, gathers) if lay.zero >= 2 else 0.0,
                            boundary_bytes=shape.boundary_bytes)
        return time, by_dim

    def evaluate(self, layout: Layout) -> Candidate:
        peak, r = self.peak(layout)
        time, by_dim = self.step_time(layout)
        return Candidate(layout, peak, r, time, by_dim)


def rank_flops(s: Shape, lay: Layout, layers: int, moe: int, head: bool) -> float:
    """FLOPs per token of the rank's tokens on a rank holding ``layers`` blocks, ``moe`` of them MoE blocks, and the
    head where ``head``: the tp-sharded part over tp; an MoE block's feed-forward runs its router, shared and k
    experts per token (``Moe.active``), whole on every tp rank (``estimate.stage_params``), whatever ep is (an
    ep rank computes the tokens its group sends to its experts: on average its own tokens' share)."""
    # the output projection's matmul costs its FLOPs whether or not its weight is tied to the embedding
    sharded = layers * s.block_params + s.vocab * s.d_model * head - (moe * s.moe.dense_ffn if moe else 0)
    dense = tm.flops_per_token(sharded, layers, s.d_model, s.seq, lay.recompute) / lay.tp
    return dense + (tm.flops_per_token(moe * s.moe.active, 0, s.d_model, s.seq, lay.recompute) if moe else 0.0)


def comm_shape(s: Shape, lay: Layout, pp_rank: int) -> cm.CommShape:
    """``comm_model.CommShape`` of one rank: raymesh reduces and gathers fp32 parameters and gradients
    (autocast keeps them fp32; FSDP2's bf16 policy gathers bf16), sends fp32 hidden states between stages
    (bf16 under that policy), reduces activations in compute width."""
    n_stages = lay.pp * lay.stages_per_rank
    ids = stage_ids(pp_rank, lay.pp, lay.stages_per_rank, lay.schedule)
    counts = lay.stage_layers(s.n_layers)
    layers = sum(counts[i] for i in ids)
    moe = sum(stage_moe_blocks(s.moe, counts)[i] for i in ids) if s.moe else 0
    last = n_stages - 1 in ids
    root = s.embedding_params * (0 in ids) + s.head_params * last
    norms = layers * 2 * s.d_model + s.d_model * last  # replicated under tp
    sharded, replicated, experts = layers * s.block_params + root, 0, 0
    if moe:  # as ``LayoutPeaks.peak``
        sharded, replicated = sharded - moe * s.moe.dense_ffn, moe * s.moe.replicated
        experts = moe * s.moe.expert_params // lay.ep
    params = sharded // lay.tp + norms + replicated
    seq, c = s.seq // lay.cp, s.compute_bytes
    sbh = seq * lay.micro_batch * s.d_model
    # under tp the token embedding's gradient comes back from DTensor's embedding backward Replicate, full-size,
    # and ZeRO-0's buckets reduce it as it is (workers/parallel/grad_buckets.py): vocab x h, not vocab/tp x h
    embedding_grad = s.vocab * s.d_model * (lay.tp - 1) // lay.tp if 0 in ids and lay.zero == 0 else 0
    # FSDP2's policy gathers 16-bit parameters and reduces in precision.reduce_dtype; autocast moves fp32
    gather, reduce = (c, s.reduce_bytes) if s.fsdp_mixed(lay.zero) else (4, s.grad_reduce_bytes if lay.zero else 4)
    # int8/bf16 gathers (workers/contract/param_gather.py): ZeRO-1's slices; FSDP2's units under the policy's width
    gather = s.param_gather_bytes if lay.zero == 1 else min(gather, s.param_gather_bytes)
    return cm.CommShape(gather * params, reduce * (params + embedding_grad), c * sbh,
                        s.boundary_width(lay.zero) * sbh // lay.tp,
                        2 * c * seq * lay.micro_batch * s.kv * s.head_size // lay.tp,
                        c * seq * lay.micro_batch * s.vocab, layers, moe, s.moe.top_k if s.moe else 1, last,
                        sum((i != 0) + (i != n_stages - 1) for i in ids) if lay.pp > 1 else 0,
                        (0 in ids) + last, 4 * norms, s.cp_impl, c * seq * lay.micro_batch * s.n_heads * s.head_size
                        // lay.tp, _kv_repeat(s.kv // lay.tp, lay.cp), 4 / c, gather * experts, reduce * experts)


def _kv_repeat(kv_heads: int, cp: int) -> int:
    """How many times Ulysses sends each (tp-local) K/V head: replicated up to cp when fewer
    (``context_parallel.ulysses_attention``)."""
    return cp // kv_heads if 0 < kv_heads < cp else 1


def layout_of(spec) -> Layout:
    """The layout a job spec runs."""
    p = spec.parallel
    # the search prices one policy for every block: memory.recompute: sqrt's segments are priced as full recompute
    # (fewer stored inputs, a larger working set in backward: ``estimate.recompute_working_bytes`` has both)
    policy = recompute_plan(spec.memory.recompute, spec.memory.recompute_every, spec.model.n_layers)[0]
    recompute = "full" if policy == "sqrt" else policy
    return Layout(p.dp, p.tp, p.pp, p.cp, p.zero, spec.train.global_batch_size // p.dp // spec.train.microbatches,
                  recompute, p.pp_schedule, p.stages_per_rank, dp_shard=p.grid.dp_shard if p.grid.hybrid else None,
                  ep=p.ep)


@functools.lru_cache(maxsize=65536)
def _layer_bytes(s: Shape, seq: int, micro_batch: int, tp: int, recompute: str, fsdp_mixed: bool = False,
                 cp: int = 1, moe: bool = False) -> int:
    """One block's saved bytes (sequence parallel whenever tp > 1; allgather's gathered K/V without recompute,
    as ``estimate.layer_bytes``; ``moe``: without the dense feed-forward, ``LayoutPeaks`` adds the MoE layer's),
    cached: candidates differing only in ZeRO stage or schedule share it."""
    ffn = 0 if moe else s.ffn_dim
    block = mm.layer_activation_bytes(seq, micro_batch, s.d_model, s.n_heads, ffn, tp, tp > 1, recompute,
                                      s.compute_bytes, kv_heads=s.kv, family=s.arch, fsdp_mixed=fsdp_mixed,
                                      head_dim=s.head_size, fused_norm=s.gpu, compiled=s.compiled)
    if s.cp_impl != "allgather" or recompute != "none":
        return block
    return block + mm.gathered_kv_bytes(s.seq, micro_batch, s.d_model, s.n_heads, s.kv, cp, tp, s.compute_bytes,
                                        s.head_size)


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def candidates(shape: Shape, world: int, g: tm.GPU, zeros=(0, 1, 2, 3), recomputes=RECOMPUTE, cps=None,
               even_splits: bool = False, schedules=("1f1b", "interleaved_1f1b"), rejected: dict | None = None,
               units: UnitTimes | None = None, fitted: set | None = None):
    """Every layout of ``world`` GPUs the formulas can price; ``rejected`` counts the others by reason. With
    ``units``, each pipelined layout also comes with ``balanced_layers``' split where it differs (and where the
    layers do not divide the stages, only with it under ``even_splits``). ``fitted``: ``_with_experts``'."""
    rejected = {} if rejected is None else rejected

    def skip(reason: str) -> None:
        rejected[reason] = rejected.get(reason, 0) + 1

    tps = [t for t in _powers_of_two(min(TP_MAX, g.gpus_per_node))
           if shape.n_heads % t == 0 and shape.kv % t == 0 and world % t == 0]
    cps = _chunkable(shape, cps or [c for c in _powers_of_two(16) if shape.seq % c == 0], skip)
    for tp, cp in product(tps, cps):
        if world % (tp * cp):
            continue
        rest = world // (tp * cp)
        for pp in (p for p in range(1, min(rest, shape.n_layers) + 1) if rest % p == 0):
            dp = rest // pp
            if shape.global_batch % dp:
                skip("global batch not divisible by dp")
                continue
            shards = hybrid_shard_sizes(dp, tp * cp * pp, g.gpus_per_node)
            for layout in _with_experts(shape, dp * cp, _per_replica(
                    shape, dp, tp, pp, cp, zeros, recomputes, even_splits, schedules, skip, units, shards), fitted):
                only_split = even_splits and shape.n_layers % (pp * layout.stages_per_rank) != 0
                if not only_split:
                    yield layout
                balanced = balanced_layers(units, pp * layout.stages_per_rank) if units and pp > 1 else None
                if balanced is not None and (only_split or balanced != layout.stage_layers(shape.n_layers)):
                    yield replace(layout, split=balanced)


def expert_degrees(shape: Shape, data_ranks: int) -> list[int]:
    """The ep degrees the search tries for a layout with ``data_ranks`` = dp x cp ranks: every divisor of both
    that and the expert count (``ParallelSpec``'s and ``check_expert_parallel``'s rules), 1 for a dense model."""
    if shape.moe is None:
        return [1]
    return [e for e in range(1, math.gcd(data_ranks, shape.moe.experts) + 1)
            if data_ranks % e == 0 and shape.moe.experts % e == 0]


def _with_experts(shape: Shape, data_ranks: int, layouts, fitted: set | None = None):
    """Each layout at every ``expert_degrees`` ep; hybrid sharding (``dp_shard``) only at ep=1: an expert group
    and a shard group over the same data ranks are not priced together.

    With ``fitted`` (the search adds each fitting layout's ``unsplit``), the largest ep comes first after ep=1,
    and the others only where it fitted on some split: from ep=2 up a rank's peak only falls as ep grows (its
    experts and their state shrink as 1/ep, the all-to-all buffers stay), so where the largest does not fit no
    smaller one does. Most of DeepSeek-V3 671B's candidate layouts on 2,048 80 GB GPUs fit at no ep degree at all:
    for those this prices 2 of the 9 degrees (its search: 6 s of CPU, not 18)."""
    degrees = expert_degrees(shape, data_ranks)
    for layout in layouts:
        yield layout
        if layout.dp_shard is not None or len(degrees) == 1:
            continue
        largest = replace(layout, ep=degrees[-1])
        yield largest
        if fitted is None or largest in fitted:
            yield from (replace(layout, ep=e) for e in reversed(degrees[1:-1]))


def _chunkable(shape: Shape, cps: list[int], skip) -> list[int]:
    """The cp degrees of ``cps`` that leave each rank at least ``train.loss_chunks`` tokens of a sequence: the
    spec refuses the others (``orchestrator/spec/checks/loss_chunks.py``), so the picker neither picks nor offers
    them."""
    for cp in cps:
        if shape.seq // cp < shape.loss_chunks:
            skip("train.loss_chunks over a rank's tokens (model.seq_len / cp)")
    return [cp for cp in cps if shape.seq // cp >= shape.loss_chunks]


def hybrid_shard_sizes(dp: int, inner: int, gpus_per_node: int) -> list[int]:
    """The ``dp_shard`` values the search tries besides plain sharding, largest first: the divisors of ``dp``
    between 2 and dp - 1 whose shard group (``dp_shard`` dp ranks, ``inner`` = tp·cp·pp ranks apart) fits in one
    node, so ZeRO's collectives run on NVLink and only the replicas' all-reduce of a shard's gradients crosses
    nodes (``time_model.data_parallel_links``). Left out: 1 (every rank holds everything: ZeRO-0 moves the same
    bytes and ties go to it) and groups spanning nodes (ZeRO's collectives on the same slow links as plain
    sharding, with more state per rank), which also keeps the search's size: at most log2(GPUs per node) more
    layouts per ZeRO-1/2/3 layout."""
    return [d for d in range(dp - 1, 1, -1) if dp % d == 0 and inner * d <= gpus_per_node]


def _per_replica(shape, dp, tp, pp, cp, zeros, recomputes, even_splits, schedules, skip, units=None, shards=()):
    """The ZeRO x micro-batch x recompute x schedule choices of one dp/tp/pp/cp split; under ZeRO 1-3 each also
    with every hybrid ``dp_shard`` of ``shards`` (``hybrid_shard_sizes``)."""
    per_replica = shape.global_batch // dp
    for sched in (schedules if pp > 1 else ("1f1b",)):
        v = 1 if sched == "1f1b" else 2
        if shape.n_layers < pp * v or (even_splits and shape.n_layers % (pp * v) and units is None):
            skip("layers do not split into the stages")
            continue
        for mbs in (b for b in _powers_of_two(per_replica) if per_replica % b == 0):
            m = per_replica // mbs
            if pp > 1 and m < schedule_facts(sched).min_microbatches(pp):
                skip("too few microbatches for the schedule")
                continue
            for zero, rc in product(zeros if dp * cp > 1 else (0,), recomputes):  # ZeRO shards over dp x cp
                for dp_shard in (None, *shards) if zero else (None,):
                    yield Layout(dp, tp, pp, cp, zero, mbs, rc, sched, v, dp_shard=dp_shard)


def search(shape: Shape, world: int, g: tm.GPU, headroom: float = 0.1, efficiency: float = tm.DEFAULT_EFFICIENCY,
           top: int = 5, **space) -> SearchResult:
    """Every layout whose in-step peak stays below (1 - ``headroom``) of the GPU's memory, fastest first
    (ties: the lower ZeRO stage, less recompute, less memory), and the ``top`` smallest that do not fit."""
    ev = Evaluator(shape, g, efficiency)
    limit = int(g.memory * (1 - headroom))
    rejected: dict[str, int] = {}
    fits, too_big, n, fitted = [], [], 0, set()
    for layout, peak, pp_rank in _priced(ev, candidates(shape, world, g, rejected=rejected, fitted=fitted, **space),
                                          space.get("units"), limit):
        n += 1
        if peak > limit:  # priced only if it fits: the step time of a layout that cannot run decides nothing
            too_big.append((peak, layout, pp_rank))
            continue
        fitted.add(layout.unsplit)
        fits.append(Candidate(layout, peak, pp_rank, *ev.step_time(layout)))
    rejected["does not fit with headroom"] = len(too_big)
    fits.sort(key=lambda c: (round(c.step_s, 6), c.layout.zero, RECOMPUTE.index(c.layout.recompute), c.peak))
    smallest = [Candidate(lay, peak, r, *ev.step_time(lay)) for peak, lay, r in sorted(too_big, key=_by_peak)[:top]]
    return SearchResult(fits, smallest, limit, ev.rank_estimates, n, rejected)


def _priced(ev: Evaluator, layouts, units: UnitTimes | None, limit: int):
    """Each layout once with its (peak, pp rank of the peak); with ``units``, a pipelined layout that does not fit
    is followed by the same layout on ``Evaluator.fitting_split``'s split, when there is one."""
    seen, refitted = set(), set()
    for layout in layouts:
        todo = [layout]
        while todo:
            lay = todo.pop()
            if lay in seen:
                continue
            seen.add(lay)
            peak, pp_rank = ev.peak(lay)
            yield lay, peak, pp_rank
            key = lay.unsplit
            if peak > limit and units is not None and lay.pp > 1 and key not in refitted:
                refitted.add(key)
                fitted = ev.fitting_split(lay, units, limit)
                if fitted is not None:
                    todo.append(replace(lay, split=fitted))


def _by_peak(item: tuple) -> int:
    return item[0]


def why_not(winner: Candidate, other: Candidate, limit: int) -> str:
    """One line: what makes ``other`` lose to ``winner`` (memory, or the term that grew most)."""
    if other.peak > limit:
        return f"needs {human_bytes(other.peak)} > {human_bytes(limit)} with headroom"
    if other.step_s - winner.step_s <= 1e-6 * winner.step_s:
        return "same predicted time; ties go to the lower ZeRO stage, less recompute, then less memory"
    a, b = winner.time.as_dict(), other.time.as_dict()
    term = max((k for k in a if k != "step_s"), key=lambda k: b[k] - a[k])
    return f"{other.step_s - winner.step_s:+.3g} s/step, mostly {term[:-2]} ({a[term]:.3g} -> {b[term]:.3g} s)"


def losers_by_axis(result: SearchResult,
                   axes=("tp", "pp", "cp", "ep", "zero", "dp_shard", "recompute", "micro_batch", "split")) -> list[str]:
    """Per axis: the fastest layout with a different value there, and why it lost (``split``: the same layout
    otherwise, on another stage split; ``dp_shard``: none is plain sharding over all of dp)."""
    if not result.best:
        return []
    win = result.best[0]
    lines = []
    pool = result.best + result.too_big
    for axis in axes:
        others = [c for c in pool if getattr(c.layout, axis) != getattr(win.layout, axis)]
        if axis == "split":
            others = [c for c in others if replace(c.layout, split=None) == replace(win.layout, split=None)]
        if others:
            alt = min(others, key=lambda c: (c.peak > result.limit, c.step_s))
            value = getattr(alt.layout, axis)
            shown = {"split": "even", "dp_shard": "none"}.get(axis, value) if value is None else value
            lines.append(f"{axis}={shown}: {alt.layout.label()}: {why_not(win, alt, result.limit)}")
    return lines


def predicted_bytes(spec) -> dict[int, dict[str, float]]:
    """Per pipeline rank of a job spec: bytes sent per step per mesh dimension (every dp/tp/cp peer of a
    pp rank sends the same). What the ``comm`` measurement puts "predicted" beside "measured"."""
    shape, layout = Shape.of(spec), layout_of(spec)
    m = layout.microbatches(shape)
    return {r: cm.step_bytes(comm_shape(shape, layout, r), layout.dp, layout.tp, layout.pp, layout.cp, layout.ep,
                             layout.zero, m, layout.dp_shard) for r in range(layout.pp)}
