"""Job spec -> per-rank memory estimate (via ``orchestrator.planning.memory_model``), and `raymesh plan` output.

This module only maps a spec onto the pure memory model: how many parameters
each rank holds (its pipeline stages, its tensor-parallel share), which
precision layout and optimizer the workers run, which microbatch size and
schedule. The layout picker lives in ``orchestrator.planning.layout_picker``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import astuple, dataclass, replace

from orchestrator.planning import memory_model as mm
from orchestrator.spec import JobSpec, ModelSpec
from orchestrator.spec.lora import adapted_linears, parameter_split
from workers.parallel.layout import layers_of_stage, stage_ids

# raymesh's bf16/fp16 keep fp32 weights, gradients and Adam state under torch.autocast
PRECISION_LAYOUT = {"fp32": "fp32", "bf16": "autocast", "fp16": "autocast"}


@dataclass
class RankEstimate:
    rank: int
    coords: dict
    stages: list[int]
    params: int
    state: mm.ModelState
    activation_bytes: int
    buffer_bytes: int
    offloaded_activation_bytes: int = 0  # saved for backward but packed off the device (memory.offload.activations)

    @property
    def total_bytes(self) -> int:
        """Peak on the device: persistent state, gathered parameters, activations, buffers."""
        return self.state.peak + self.activation_bytes + self.buffer_bytes

    def as_dict(self) -> dict:
        return {"rank": self.rank, "params": self.params, **self.state.as_dict(),
                "activations": self.activation_bytes, "buffers": self.buffer_bytes, "total": self.total_bytes}


def stage_params(spec: JobSpec, stage: int, n_stages: int) -> tuple[int, int]:
    """(tensor-parallel-sharded params, replicated params) of one pipeline stage; routed experts apart
    (``stage_expert_params``), an MoE block's router and shared experts counted here."""
    m = spec.model
    d, v = m.d_model, m.vocab_size
    layers = layers_of_stage(stage, n_stages, m.n_layers)
    sharded = sum(dense_block_params(spec, i) for i in layers)
    replicated = len(layers) * 2 * d
    if stage == 0:
        sharded += v * d + (m.seq_len * d if m.positions == "learned" else 0)
    if stage == n_stages - 1:
        sharded += 0 if m.tie_embeddings else d * v  # a tied head is the embedding (one stage: refused otherwise)
        replicated += d
    return sharded, replicated


# feed-forward matrices per block: GPT's up/down, Llama's SwiGLU gate/up/down
FFN_MATRICES = {"gpt": 2, "llama": 3}


def block_params(spec: JobSpec) -> int:
    """The tensor-parallel-sharded parameters of one block: q and o (d x d), k and v (d x n_kv_heads*head_dim,
    smaller under grouped-query attention), and the feed-forward's matrices (``FFN_MATRICES``)."""
    m = spec.model
    d, kv = m.d_model, m.kv_heads * m.head_dim
    return 2 * d * d + 2 * d * kv + FFN_MATRICES[m.arch] * d * m.ffn_dim


def dense_block_params(spec: JobSpec, layer: int) -> int:
    """``block_params`` of block ``layer``, an MoE block's feed-forward being its router and shared experts."""
    replaced, dense, _ = moe_params(spec, layer)
    return block_params(spec) - replaced + dense


def moe_params(spec: JobSpec, layer: int) -> tuple[int, int, int]:
    """Block ``layer``'s (dense feed-forward it replaces, router + shared experts, routed experts); zeros for a
    dense block. Routed experts are what expert parallelism splits over ``parallel.ep``."""
    m, moe = spec.model, spec.model.moe
    if moe is None or not m.is_moe_layer(layer):
        return 0, 0, 0
    ffn = FFN_MATRICES[m.arch] * m.d_model * (moe.d_expert or m.ffn_dim)
    router = m.d_model * moe.experts * (2 if moe.router == "noisy_topk" else 1)  # noisy top-k: W_g and W_noise
    return FFN_MATRICES[m.arch] * m.d_model * m.ffn_dim, router + moe.shared_experts * ffn, moe.experts * ffn


def stage_expert_params(spec: JobSpec, stage: int, n_stages: int) -> int:
    """Routed-expert parameters of one pipeline stage, all experts (a rank holds ``1 / ep`` of them)."""
    return sum(moe_params(spec, i)[2] for i in layers_of_stage(stage, n_stages, spec.model.n_layers))


def all_to_all_bytes(spec: JobSpec) -> int:
    """Expert parallelism's transient buffers: one MoE layer's dispatch and combine, each a send and a receive
    buffer of the microbatch's routed rows (tokens × k, d_model wide) at the compute precision."""
    m, moe = spec.model, spec.model.moe
    if moe is None or not spec.parallel.grid.ep_enabled:
        return 0
    rows = m.seq_len * micro_batch(spec) * (moe.k if moe.router != "expert_choice" else moe.capacity_factor)
    return math.ceil(4 * rows * m.d_model * compute_bytes(spec))


def offload_flags(spec: JobSpec) -> dict[str, bool]:
    """``memory.offload.{optimizer,params,activations}``: what the model counts off the device."""
    offload = spec.memory.offload
    return {"optimizer": offload.optimizer, "params": offload.params, "activations": offload.activations}


def sequence_split(spec: JobSpec) -> bool:
    """Whether activations outside attention/MLP are split over tp ranks: sequence parallelism acts only with TP on."""
    return spec.parallel.grid.tp_enabled and spec.parallel.sequence_parallel


def micro_batch(spec: JobSpec) -> int:
    return spec.train.global_batch_size // spec.parallel.dp // spec.train.microbatches


def compute_bytes(spec: JobSpec) -> int:
    return mm.BYTES_PER[spec.precision.dtype]


def layer_bytes(spec: JobSpec, layer: int = 0) -> int:
    """Saved for backward by one block (``layer``: which, where LoRA adapts blocks differently) for one microbatch."""
    m, p = spec.model, spec.parallel
    return mm.layer_activation_bytes(m.seq_len, micro_batch(spec), m.d_model, m.n_heads, m.ffn_dim, p.tp,
                                     sequence_split(spec), spec.memory.recompute, compute_bytes(spec),
                                     frozen=frozen_parts(spec)[layer], kv_heads=m.kv_heads, family=m.arch)


def frozen_parts(spec: JobSpec) -> list[mm.Frozen | None]:
    """Per block, then the head: what LoRA leaves trainable (``mm.Frozen``), or all None without LoRA."""
    return _frozen_parts(spec.model.model_dump_json())


@functools.lru_cache(maxsize=16)
def _frozen_parts(model_json: str) -> list[mm.Frozen | None]:
    """Cached on the model section: target matching builds the model on the meta device."""
    model = ModelSpec.model_validate_json(model_json)
    n = model.n_layers
    if model.lora is None:
        return [None] * (n + 1)
    names = adapted_linears(model)
    parts, grad = [], False  # the frozen embedding's output needs no gradient
    for i in range(n):
        adapted = frozenset(name.rsplit(".", 1)[1] for name in names if name.startswith(f"layers.{i}."))
        parts.append(mm.Frozen(adapted, model.lora.rank, grad))
        grad = parts[-1].output_grad()
    return [*parts, mm.Frozen(frozenset(names & {"output"}), model.lora.rank, grad)]


def chunk_activation_bytes(spec: JobSpec, stage: int, n_stages: int) -> int:
    """One microbatch through one pipeline stage's blocks (and embedding where it holds it); no head.
    A frozen (LoRA) embedding saves nothing: its weight needs no gradient."""
    trained_embedding = stage == 0 and spec.model.lora is None
    embedding = mm.embedding_activation_bytes(spec.model.seq_len, micro_batch(spec)) if trained_embedding else 0
    return sum(layer_bytes(spec, i) for i in layers_of_stage(stage, n_stages, spec.model.n_layers)) + embedding


def head_bytes(spec: JobSpec) -> int:
    m, p = spec.model, spec.parallel
    return mm.head_activation_bytes(m.seq_len, micro_batch(spec), m.d_model, m.vocab_size, p.tp,
                                    sequence_split(spec), compute_bytes(spec), frozen_parts(spec)[-1])


def rank_saved_activation_bytes(spec: JobSpec, ids: list[int], pp_rank: int) -> int:
    """Saved for backward on this rank, before activation offload packs any away: its average chunk
    times the chunk-microbatches its schedule keeps in flight, plus the head.

    The head (final norm, logits' log-softmax) is in flight once: every schedule but
    GPipe runs a microbatch's loss backward right after its forward (measured on
    interleaved 1F1B: averaging the head into the chunks over-predicted by 30%).
    """
    p = spec.parallel
    n_stages = p.pp * p.stages_per_rank
    chunks = [chunk_activation_bytes(spec, sid, n_stages) for sid in ids]
    in_flight = mm.in_flight_microbatches(p.pp_schedule, p.pp, pp_rank, spec.train.microbatches, len(ids))
    heads = 0
    if n_stages - 1 in ids:
        every_microbatch = p.grid.pp_enabled and p.pipeline_schedule.all_forwards_first
        heads = head_bytes(spec) * (spec.train.microbatches if every_microbatch else 1)
    return sum(chunks) * in_flight // len(ids) + heads


def autocast_copy_bytes(spec: JobSpec, params: int) -> int:
    """autocast's 16-bit copy of every weight it casts, saved for backward by the matmuls."""
    return compute_bytes(spec) * params if spec.precision.dtype != "fp32" else 0


def pipeline_buffer_bytes(spec: JobSpec, ids: list[int]) -> int:
    """PyTorch's PipelineStage allocates, per microbatch, a receive buffer for a stage's input
    (all but the first stage) and one for its output's gradient (all but the last): fp32
    hidden states, sequence-sharded under sequence parallelism."""
    p, m = spec.parallel, spec.model
    if not p.grid.pp_enabled:
        return 0
    n_stages = p.pp * p.stages_per_rank
    hidden = 4 * m.seq_len * micro_batch(spec) * m.d_model // (p.tp if sequence_split(spec) else 1)
    edges = sum((sid != 0) + (sid != n_stages - 1) for sid in ids)
    return spec.train.microbatches * hidden * edges


def buffer_bytes(spec: JobSpec, params: int, ids: list[int], trainable: int) -> int:
    """Buffers beside model state and activations: autocast's weight copies, DDP's flat
    all-reduce buckets (ZeRO-1 with dp > 1), as large as the gradients
    (``gradient_as_bucket_view`` is off), the pipeline's receive buffers and the all-to-all's."""
    p = spec.parallel
    buckets = 4 * trainable if p.zero == 1 and p.grid.dp_enabled else 0
    return buckets + autocast_copy_bytes(spec, params) + pipeline_buffer_bytes(spec, ids) + all_to_all_bytes(spec)


def rank_parameter_split(spec: JobSpec, params: int, ids: list[int], n_stages: int) -> dict[str, int]:
    """This rank's ``params`` split into trainable, frozen and NF4 (``lora_spec.parameter_split``; all
    trainable without LoRA): adapters on the Linears of its stages, TP-sharded as placed."""
    if spec.model.lora is None:
        return {"trainable": params, "frozen": 0, "nf4": 0}
    layers = {i for s in ids for i in layers_of_stage(s, n_stages, spec.model.n_layers)}

    def holds(name: str) -> bool:
        if name.startswith("layers."):
            return int(name.split(".")[1]) in layers
        return n_stages - 1 in ids  # the output head

    return parameter_split(spec, holds, spec.parallel.tp, params)


def nf4_gathered_params(spec: JobSpec, ids: list[int], n_stages: int) -> int:
    """QLoRA's NF4 base weights within ZeRO-3's gathered units (root, two blocks): module buffers,
    which FSDP2 neither shards nor all-gathers, so the gathered term leaves them out."""
    lora = spec.model.lora
    if lora is None or lora.quantize != "nf4":
        return 0
    block = min(i for s in ids for i in layers_of_stage(s, n_stages, spec.model.n_layers))
    head = n_stages - 1 in ids
    root = parameter_split(spec, lambda name: name == "output" and head, spec.parallel.tp, 0)["nf4"]
    blocks = parameter_split(spec, lambda name: name.startswith(f"layers.{block}."), spec.parallel.tp, 0)["nf4"]
    return root + 2 * blocks


def rank_model_state(spec: JobSpec, split: dict[str, int], ids: list[int], n_stages: int) -> mm.ModelState:
    p, o = spec.parallel, spec.optim
    blocks = [i for sid in ids for i in layers_of_stage(sid, n_stages, spec.model.n_layers)]
    root = sum(stage_params(spec, sid, n_stages)[0] for sid in ids) - sum(dense_block_params(spec, i) for i in blocks)
    # ZeRO-3 on FSDP2: the root unit (embeddings, head) stays gathered from forward through
    # backward, plus the block being computed and the one prefetched
    gathered = (root + 2 * block_params(spec)) // p.tp - nf4_gathered_params(spec, ids, n_stages)
    offload = offload_flags(spec)
    experts = split.get("experts", 0)
    state = mm.model_state(split["trainable"] - experts, p.dp, p.zero, PRECISION_LAYOUT[spec.precision.dtype],
                           o.name, momentum=o.momentum > 0, fsdp=True, zero3_gathered_params=gathered,
                           offload_optimizer=offload["optimizer"], offload_params=offload["params"],
                           host_master=p.device != "cpu", frozen=split["frozen"],
                           quantized_bytes=math.ceil(mm.NF4_BYTES_PER_WEIGHT * split["nf4"]))
    if experts:  # this rank's routed experts: reduced and ZeRO-sharded over the dp / ep ranks holding them
        layer = max(moe_params(spec, i)[2] for i in range(spec.model.n_layers)) // p.ep  # one gathered at a time
        own = mm.model_state(experts, p.dp // p.ep, p.zero, PRECISION_LAYOUT[spec.precision.dtype], o.name,
                             momentum=o.momentum > 0, fsdp=True, zero3_gathered_params=layer,
                             offload_optimizer=offload["optimizer"], offload_params=offload["params"],
                             host_master=p.device != "cpu")
        state = mm.ModelState(*(a + b for a, b in zip(astuple(state), astuple(own))))
    if p.grid.tp_enabled and p.zero < 2 and 0 in ids and spec.model.lora is None:
        # measured: DTensor gives the vocabulary-sharded embedding a gradient of the full vocabulary
        # on every tp rank (FSDP2, zero >= 2, reshards it); 14% of the tiny model's gradients
        vocab_rows = spec.model.vocab_size * spec.model.d_model
        state = replace(state, grads=state.grads + 4 * (vocab_rows - vocab_rows // p.tp))
    return state


def estimate_rank(spec: JobSpec, rank: int) -> RankEstimate:
    p = spec.parallel
    n_stages = p.pp * p.stages_per_rank
    coords = p.grid.coords_dict(rank)
    ids = stage_ids(coords["pp"], p.pp, p.stages_per_rank, p.pp_schedule)
    params = 0
    for sid in ids:
        sharded, replicated = stage_params(spec, sid, n_stages)
        params += sharded // p.tp + replicated
    experts = sum(stage_expert_params(spec, sid, n_stages) for sid in ids) // p.ep
    params += experts
    split = {**rank_parameter_split(spec, params, ids, n_stages), "experts": experts}
    saved = rank_saved_activation_bytes(spec, ids, coords["pp"])
    largest = max(layer_bytes(spec, i) for i in range(spec.model.n_layers))
    on_device = mm.device_activation_bytes(saved, largest, offload_flags(spec)["activations"])
    return RankEstimate(rank, coords, ids, params, rank_model_state(spec, split, ids, n_stages), on_device,
                        buffer_bytes(spec, params, ids, split["trainable"]), saved - on_device)


def estimate(spec: JobSpec) -> list[RankEstimate]:
    return [estimate_rank(spec, rank) for rank in spec.parallel.grid.ranks()]


def peak_rank(spec: JobSpec) -> RankEstimate:
    return max(estimate(spec), key=lambda r: r.total_bytes)


def render(spec: JobSpec, one_per_stage: bool = False) -> str:
    """The per-rank table; ``one_per_stage`` keeps one rank per pp coordinate (dp and tp peers are alike)."""
    p = spec.parallel
    rows = estimate(spec)
    if one_per_stage:
        rows = [r for r in rows if r.coords["dp"] == 0 and r.coords["tp"] == 0]
    lines = [
        f"job {spec.name}: dp={p.dp} x pp={p.pp} x tp={p.tp} = {p.world_size} ranks, zero={p.zero}, "
        f"schedule={p.pp_schedule} ({p.stages_per_rank} stage(s)/rank), precision={spec.precision.dtype}, "
        f"recompute={spec.memory.recompute}",
        f"{'rank':>4} {'dp':>3} {'pp':>3} {'tp':>3} {'stages':>8} {'params':>12} {'weights':>10} {'grads':>10} "
        f"{'optim':>10} {'gathered':>10} {'activ':>10} {'buffers':>10} {'total':>10}",
    ]
    for r in rows:
        s = r.state
        lines.append(
            f"{r.rank:>4} {r.coords['dp']:>3} {r.coords['pp']:>3} {r.coords['tp']:>3} "
            f"{','.join(map(str, r.stages)):>8} {r.params:>12,} "
            + " ".join(_mib(n) for n in (s.params, s.grads, s.optimizer, s.gathered, r.activation_bytes,
                                          r.buffer_bytes, r.total_bytes))
        )
    offloaded = max(r.state.offloaded for r in rows)
    if offloaded:
        off = spec.memory.offload
        what = [name for name, on in (("parameter shards", off.params),
                                      ("optimizer state", off.optimizer or spec.optim.name == "paged_adamw")) if on]
        lines.append(f"offloaded to the {off.tier} store, not counted above: up to {_mib(offloaded).strip()} a rank "
                     f"({' + '.join(what)})")
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:>8.2f}Mi"
