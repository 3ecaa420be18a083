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
from orchestrator.planning.layout_search import Shape, planned_compiled_loss, planned_on_gpu
from orchestrator.planning.moe_terms import FFN_MATRICES, all_to_all_bytes, expert_tp, moe_activation_bytes, moe_params
from orchestrator.planning.stage_split import auto_split, resolve_split
from orchestrator.spec import JobSpec, ModelSpec
from orchestrator.spec.lora import adapted_linears, parameter_split
from orchestrator.spec.sections import recompute_plan
from workers.contract.compression_kinds import WITH_FEEDBACK
from workers.contract.mixed_precision import planned_fsdp_mixed
from workers.parallel.layout import layers_of_stage, own_stages

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
    grads_at_activation_peak: bool = False  # a backward finished before the rank's activations peak
    working_bytes: int = 0  # recompute's working memory: one block's activations rebuilt in backward
    freed_in_backward: int = 0  # activations backward frees first: the head's, or one pipeline microbatch's
    regathers: bool = False  # ZeRO-3: parameters resharded after forward, gathered again in backward
    feedback_bytes: int = 0  # compression's error feedback, within ``buffer_bytes`` (``error_feedback_bytes``)
    loss_bytes: int = 0  # the loss backward's transient gradients on the head's rank (``loss_bytes``)

    @property
    def total_bytes(self) -> int:
        """In-step peak on the device: weights, optimizer state, gathered parameters and buffers all step long,
        plus the larger of (activations at their peak + gradients already there) and (all gradients, at the end
        of backward), plus recompute's working memory. Gradients and activations do not peak together: a step's
        first backward starts producing gradients as it frees activations (``zero_grad(set_to_none=True)``);
        ZeRO-3 gathers its parameters again only in backward (``memory_model.in_step_peak``). The head's rank
        adds the loss backward's float32 gradients over the vocabulary to the first moment."""
        return mm.in_step_peak(self.state, self.activation_bytes, self.grads_at_activation_peak,
                               self.regathers, self.freed_in_backward, self.working_bytes,
                               self.loss_bytes) + self.buffer_bytes

    def as_dict(self) -> dict:
        return {"rank": self.rank, "params": self.params, **self.state.as_dict(),
                "activations": self.activation_bytes, "working": self.working_bytes, "buffers": self.buffer_bytes,
                "total": self.total_bytes}


def stage_layers(spec: JobSpec, stage: int, n_stages: int, split: tuple[int, ...] | None = None) -> range:
    """The global layers of pipeline ``stage``: ``split`` (another split the planner weighs), else the job's
    ``parallel.pp_split`` when ``n_stages`` is the job's stage count, an even split otherwise (the FLOPs count's
    whole model as one stage)."""
    return layers_of_stage(stage, n_stages, spec.model.n_layers, split or resolve_split(spec))


def stage_params(spec: JobSpec, stage: int, n_stages: int, split: tuple[int, ...] | None = None) -> tuple[int, int]:
    """(tensor-parallel-sharded params, replicated params) of one pipeline stage; routed experts apart
    (``stage_expert_params``), an MoE block's router and shared experts counted here as replicated (the MoE
    feed-forward is whole on every tp rank: ``workers.parallel.gpt_parallel.moe_style``)."""
    m = spec.model
    d, v = m.d_model, spec.padded_vocab_size  # the rows the ranks build (a multiple of tp)
    layers = stage_layers(spec, stage, n_stages, split)
    sharded = sum(sharded_block_params(spec, i) for i in layers)
    replicated = sum(replicated_block_params(spec, i) for i in layers)
    if stage == 0:
        sharded += v * d + (m.seq_len * d if m.positions == "learned" else 0)
    if stage == n_stages - 1:
        sharded += 0 if m.tie_embeddings else d * v  # a tied head is the embedding (one stage: refused otherwise)
        replicated += d
        sharded, replicated = sharded + mtp_params(spec)[0], replicated + mtp_params(spec)[1]
    return sharded, replicated


def mtp_layers(spec: JobSpec) -> range:
    """The global block indices of the multi-token prediction depths (``model.mtp_layers``), after the main
    model's blocks; empty without them."""
    m = spec.model
    return range(m.n_layers, m.n_layers + getattr(m, "mtp_layers", 0))


def mtp_params(spec: JobSpec) -> tuple[int, int, int]:
    """(sharded, replicated, routed-expert) parameters of the multi-token prediction depths (with the head,
    ``workers.model.mtp``): each a block of the family's kind at its index, the 2d -> d ``eh_proj`` and three
    norms (``enorm``, ``hnorm``, the one before the shared head). The embedding and head are the main model's."""
    d, depths = spec.model.d_model, mtp_layers(spec)
    sharded = sum(sharded_block_params(spec, i) + 2 * d * d for i in depths)
    replicated = sum(replicated_block_params(spec, i) + 3 * d for i in depths)
    return sharded, replicated, sum(moe_params(spec, i)[2] for i in depths)


def block_params(spec: JobSpec) -> int:
    """The tensor-parallel-sharded parameters of one block (``layout_search.Shape.block_params``: q and o,
    k and v smaller under grouped-query attention, the feed-forward's matrices)."""
    return Shape.of(spec).block_params


def sharded_block_params(spec: JobSpec, layer: int) -> int:
    """``block_params`` of block ``layer`` less an MoE block's dense feed-forward (its MoE layer is replicated) and
    what the family's tp plan keeps whole otherwise (``kept_whole``)."""
    return block_params(spec) - moe_params(spec, layer)[0] - kept_whole(spec, layer)


def replicated_block_params(spec: JobSpec, layer: int) -> int:
    """Block ``layer``'s parameters every tp rank holds whole: its norms, an MoE block's router and shared experts,
    and ``kept_whole``."""
    return Shape.of(spec).block_replicated + moe_params(spec, layer)[1] + kept_whole(spec, layer)


def kept_whole(spec: JobSpec, layer: int) -> int:
    """Parameters of block ``layer`` that DeepSeek-V3's tp plan (``workers.parallel.deepseek_parallel``) places
    unlike the generic count: MLA's down projections and latent norms stay whole on every tp rank, an MoE block's
    shared experts are split by hidden units. Their net move from the sharded count to the replicated one (negative:
    the other way); 0 for another family."""
    m = spec.model
    if m.arch != "deepseek_v3":
        return 0
    down = (m.q_lora_rank * (m.d_model + 1) if m.q_lora_rank else 0) + m.d_model * (
        m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
    moe = m.moe
    shared = (moe.shared_experts * FFN_MATRICES[m.arch] * m.d_model * (moe.d_expert or m.ffn_dim)
              if moe is not None and m.is_moe_layer(layer) else 0)
    return down - shared


def stage_expert_params(spec: JobSpec, stage: int, n_stages: int) -> int:
    """Routed-expert parameters of one pipeline stage, all experts (a rank holds ``1 / ep`` of them); the last
    stage's include the multi-token prediction depths'."""
    mtp = mtp_params(spec)[2] if stage == n_stages - 1 else 0
    return mtp + sum(moe_params(spec, i)[2] for i in stage_layers(spec, stage, n_stages))


def expert_split(spec: JobSpec) -> int:
    """Into how many parts the routed experts are cut: ``ep``, times tp under expert tensor parallelism."""
    return spec.parallel.ep * expert_tp(spec)


def offload_flags(spec: JobSpec) -> dict[str, bool]:
    """``memory.offload.{optimizer,params,activations}``: what the model counts off the device."""
    offload = spec.memory.offload
    return {"optimizer": offload.optimizer, "params": offload.params, "activations": offload.activations}


def sequence_split(spec: JobSpec) -> bool:
    """Whether activations outside attention/MLP are split over tp ranks: sequence parallelism acts only with TP on."""
    return spec.parallel.grid.tp_enabled and spec.parallel.sequence_parallel


def local_seq(spec: JobSpec) -> int:
    """Tokens of each sequence one rank holds: ``seq_len / cp`` (context parallelism splits every sequence)."""
    return spec.model.seq_len // spec.parallel.cp


def micro_batch(spec: JobSpec) -> int:
    return spec.train.global_batch_size // spec.parallel.dp // spec.train.microbatches


def compute_bytes(spec: JobSpec) -> int:
    return mm.BYTES_PER[spec.precision.dtype]


def layer_bytes(spec: JobSpec, layer: int = 0, recompute: str | None = None) -> int:
    """Saved for backward by one block (``layer``: which, where LoRA adapts blocks differently) for one microbatch,
    under ``recompute`` (default: the job's ``memory.recompute``)."""
    m, p = spec.model, spec.parallel
    frozen = frozen_parts(spec)[layer]
    rc = mm.layer_recompute(recompute or spec.memory.recompute, spec.memory.recompute_every, layer, m.n_layers)
    if rc == "segment":  # inside a sqrt segment: its first block's input is all the segment stores
        return 0
    moe = m.moe is not None and m.is_moe_layer(layer)
    block = mm.layer_activation_bytes(local_seq(spec), micro_batch(spec), m.d_model, m.n_heads,
                                      0 if moe else m.ffn_dim, p.tp, sequence_split(spec), rc, compute_bytes(spec),
                                      frozen=frozen, kv_heads=m.kv_heads, family=m.arch, fsdp_mixed=fsdp_mixed(spec),
                                      head_dim=m.head_size, fused_norm=planned_on_gpu(spec),
                                      compiled=spec.train.compile)
    if rc == "full" and spec.memory.partition_activations != "none":
        return partitioned_input_bytes(spec, block)
    if moe and rc != "full":  # the dense feed-forward's input copies out, the MoE layer's tensors in
        ffn_inputs = compute_bytes(spec) * local_seq(spec) * micro_batch(spec) * m.d_model * mm.feed_forward_copies(
            m.arch, compute_bytes(spec), frozen, fsdp_mixed(spec))
        block += moe_activation_bytes(spec) - ffn_inputs
    attn_grad = frozen is None or frozen.input_grad or bool(frozen.adapted)
    if p.cp_impl != "allgather" or rc != "none" or not attn_grad:
        return block
    return block + mm.gathered_kv_bytes(m.seq_len, micro_batch(spec), m.d_model, m.n_heads, m.kv_heads, p.cp, p.tp,
                                        compute_bytes(spec), m.head_size)


def partitioned_input_bytes(spec: JobSpec, whole: int) -> int:
    """ZeRO-R's Pa (``memory.partition_activations``): of a stored block input of ``whole`` bytes, this rank's
    device keeps its flat 1/tp slice (padded to whole elements: ``workers.parallel.partitioned_activations``), or
    nothing when the slice waits in host memory."""
    if spec.memory.partition_activations == "host":
        return 0
    elements = local_seq(spec) * micro_batch(spec) * spec.model.d_model
    return -(-elements // spec.parallel.tp) * (whole // elements)


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
    embedding = mm.embedding_activation_bytes(local_seq(spec), micro_batch(spec)) if trained_embedding else 0
    layers = stage_layers(spec, stage, n_stages)
    return sum(layer_bytes(spec, i) for i in layers) + embedding + document_bytes(spec, layers)


def document_bytes(spec: JobSpec, layers) -> int:
    """The document mask a chunk of ``layers`` saves per microbatch (``mm.document_mask_bytes``): under
    ``model.attention_mask: document`` where one of its blocks keeps its attention's inputs (no recompute)."""
    m, p, mem = spec.model, spec.parallel, spec.memory
    kept = any(mm.layer_recompute(mem.recompute, mem.recompute_every, i, m.n_layers) == "none" for i in layers)
    if m.attention_mask != "document" or not kept:
        return 0
    return mm.document_mask_bytes(m.seq_len, micro_batch(spec), p.cp, p.cp_impl, compute_bytes(spec))


def head_bytes(spec: JobSpec) -> int:
    m, p = spec.model, spec.parallel
    return mm.head_activation_bytes(local_seq(spec), micro_batch(spec), m.d_model, spec.padded_vocab_size, p.tp,
                                    sequence_split(spec), compute_bytes(spec), frozen_parts(spec)[-1], fsdp_mixed(spec),
                                    spec.train.loss_chunks, planned_on_gpu(spec) and not spec.train.compile)


def loss_bytes(spec: JobSpec, ids: list[int]) -> int:
    """The loss backward's transient (``memory_model.loss_backward_bytes``) where this rank holds the head and
    its logits need a gradient (a LoRA run with nothing trainable before the head has no backward)."""
    p, head = spec.parallel, frozen_parts(spec)[-1]
    if p.n_stages - 1 not in ids or not (head is None or head.output_grad()):
        return 0
    vocab = spec.padded_vocab_size
    head_grad = 4 * vocab * spec.model.d_model // p.tp if head is None else 0  # LoRA: the head weight is frozen
    return mm.loss_backward_bytes(local_seq(spec), micro_batch(spec), vocab, spec.train.loss_chunks, head_grad,
                                  planned_compiled_loss(spec))


def rank_saved_activation_bytes(spec: JobSpec, ids: list[int], pp_rank: int) -> int:
    """Saved for backward on this rank, before activation offload packs any away (``mm.rank_saved_bytes``: its
    average chunk times the chunk-microbatches its schedule keeps in flight, plus ``mm.head_copies`` heads)."""
    p = spec.parallel
    n_stages = p.n_stages
    chunks = sum(chunk_activation_bytes(spec, sid, n_stages) for sid in ids)
    heads = mm.head_copies(n_stages - 1 in ids, p.grid.pp_enabled, p.pipeline_schedule.all_forwards_first,
                           spec.train.microbatches)
    return mm.rank_saved_bytes(chunks, len(ids), _in_flight(spec, ids, pp_rank), head_bytes(spec) if heads else 0,
                               heads)


def rank_mask_bytes(spec: JobSpec, ids: list[int], pp_rank: int) -> int:
    """The document masks among ``rank_saved_activation_bytes`` (one per chunk-microbatch in flight): activation
    offload and compression leave them on the device as they are (``workers.model.documents.is_shared_mask``)."""
    n_stages = spec.parallel.n_stages
    masks = sum(document_bytes(spec, stage_layers(spec, sid, n_stages)) for sid in ids)
    return mm.rank_saved_bytes(masks, len(ids), _in_flight(spec, ids, pp_rank), 0, 0)


def _in_flight(spec: JobSpec, ids: list[int], pp_rank: int) -> int:
    """Chunk-microbatches whose activations this rank holds at its peak (``mm.in_flight_microbatches``)."""
    p = spec.parallel
    if p.replicated_stages is not None:  # GPipe's order over this replica's round-robin share of the microbatches
        return len(p.replicated_stages.microbatches_of(*p.replicated_stages.stage_of(pp_rank), spec.train.microbatches))
    return mm.in_flight_microbatches(p.pp_schedule, p.pp, pp_rank, spec.train.microbatches, len(ids))


def fsdp_mixed(spec: JobSpec) -> bool:
    """Whether bf16 runs through FSDP2's mixed-precision policy (``precision.policy``, resolved as the ranks
    resolve it; ``parallel.device: auto`` is planned as a GPU)."""
    pr, p = spec.precision, spec.parallel
    return planned_fsdp_mixed(pr.dtype, pr.policy, p.zero, p.dp_sync, p.device)


def precision_layout(spec: JobSpec) -> str:
    """The memory model's precision layout (``memory_model.PRECISIONS``) of this job."""
    return "fsdp_mixed" if fsdp_mixed(spec) else PRECISION_LAYOUT[spec.precision.dtype]


def precision_note(spec: JobSpec) -> str:
    """How 16-bit precision runs, for the plan's job line (nothing for fp32)."""
    if spec.precision.dtype == "fp32":
        return ""
    return " (FSDP2 policy)" if fsdp_mixed(spec) else " (autocast)"


def autocast_copy_bytes(spec: JobSpec, params: int) -> int:
    """autocast's 16-bit copy of every weight it casts, saved for backward by the matmuls (none under FSDP2's
    policy: its bf16 weights are the gathered parameters, freed and gathered again as ZeRO-2/3 say)."""
    return compute_bytes(spec) * params if spec.precision.dtype != "fp32" and not fsdp_mixed(spec) else 0


def pipeline_buffer_bytes(spec: JobSpec, ids: list[int]) -> int:
    """PyTorch's PipelineStage allocates, per microbatch, a receive buffer for a stage's input
    (all but the first stage) and one for its output's gradient (all but the last): fp32
    hidden states (bf16 under FSDP2's policy), sequence-sharded under sequence parallelism."""
    p, m = spec.parallel, spec.model
    if not p.grid.pp_enabled:
        return 0
    n_stages = p.n_stages
    width = compute_bytes(spec) if fsdp_mixed(spec) else 4  # FSDP2's policy: the stages send bf16
    hidden = width * local_seq(spec) * micro_batch(spec) * m.d_model // (p.tp if sequence_split(spec) else 1)
    return spec.train.microbatches * hidden * mm.pipeline_edges(ids, n_stages)


def stashed_weight_bytes(spec: JobSpec, trainable: int, pp_rank: int) -> int:
    """PipeDream's stashed weight versions (fp32 copies of the stage's trainable weights) at the rank's peak:
    one per microbatch in flight (pp - r), two under 2BW, none for the synchronous schedules."""
    p = spec.parallel
    if not p.grid.pp_enabled:
        return 0
    return 4 * trainable * p.pipeline_schedule.weight_copies(p.pp, pp_rank, spec.train.microbatches)


def error_feedback_bytes(spec: JobSpec, trainable: int) -> int:
    """What compression holds back on a rank for the next step, one fp32 value per trainable weight: PowerSGD's
    and top-k's error per gradient bucket, 1-bit Adam's per parameter. PowerSGD's Q factors (rank x columns per
    matrix) are left out: under 1% at rank 4 of any matrix wider than 400. In-memory snapshots copy it too."""
    on = spec.parallel.grad_compression in WITH_FEEDBACK or spec.optim.name == "onebit_adam"
    return 4 * trainable if on else 0


def buffer_bytes(spec: JobSpec, params: int, ids: list[int], trainable: int, pp_rank: int = 0) -> int:
    """Buffers beside model state and activations: autocast's weight copies, the pipeline's receive buffers, the
    cp kernel's and the all-to-all's, PipeDream's stashed weight versions, compression's error feedback. ZeRO-0/1's
    flat gradient copies for their reduction are model state (``ModelState.reducing``): they exist only after
    backward, so they do not add to the activations' peak as these do."""
    p, m = spec.parallel, spec.model
    cp = mm.cp_buffer_bytes(p.cp_impl, m.seq_len, micro_batch(spec), m.d_model, m.n_heads, m.kv_heads, p.cp, p.tp,
                            compute_bytes(spec), m.head_size)
    return (autocast_copy_bytes(spec, params) + pipeline_buffer_bytes(spec, ids) + cp
            + all_to_all_bytes(spec) + stashed_weight_bytes(spec, trainable, pp_rank)
            + error_feedback_bytes(spec, trainable))


def rank_parameter_split(spec: JobSpec, params: int, ids: list[int], n_stages: int) -> dict[str, int]:
    """This rank's ``params`` split into trainable, frozen and NF4 (``lora_spec.parameter_split``; all
    trainable without LoRA): adapters on the Linears of its stages, TP-sharded as placed."""
    if spec.model.lora is None:
        return {"trainable": params, "frozen": 0, "nf4": 0}
    layers = {i for s in ids for i in stage_layers(spec, s, n_stages)}

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
    block = min(i for s in ids for i in stage_layers(spec, s, n_stages))
    head = n_stages - 1 in ids
    root = parameter_split(spec, lambda name: name == "output" and head, spec.parallel.tp, 0)["nf4"]
    blocks = parameter_split(spec, lambda name: name.startswith(f"layers.{block}."), spec.parallel.tp, 0)["nf4"]
    return root + 2 * blocks


def blocks_per_unit(spec: JobSpec) -> int:
    """Blocks in one FSDP2 unit: 1, or as many as ``parallel.fsdp_bucket_mb`` holds, counted as
    ``workers.parallel.data_parallel.fsdp_units`` counts them (this rank's tp shard, in the all-gather's dtype)."""
    bucket = spec.parallel.fsdp_bucket_mb
    if bucket is None:
        return 1
    per_block = block_params(spec) // spec.parallel.tp * (compute_bytes(spec) if fsdp_mixed(spec) else 4)
    return max(1, int(bucket * 2**20 // per_block))


def rank_model_state(spec: JobSpec, split: dict[str, int], ids: list[int], n_stages: int) -> mm.ModelState:
    p, o = spec.parallel, spec.optim
    name = stepped_optimizer(spec)
    blocks = [i for sid in ids for i in stage_layers(spec, sid, n_stages)]
    root = sum(stage_params(spec, sid, n_stages)[0] for sid in ids) - sum(sharded_block_params(spec, i) for i in blocks)
    gathered = (mm.zero3_gathered_params(root, block_params(spec) * blocks_per_unit(spec), p.tp, p.fsdp_prefetch)
                - nf4_gathered_params(spec, ids, n_stages))
    offload = offload_flags(spec)
    experts = split.get("experts", 0)
    steps = {"accumulating": accumulates(spec), "pipelined": p.grid.pp_enabled, "gloo": p.device == "cpu",
             "state_dtype": o.state_dtype}
    # ZeRO shards over dp x cp (hybrid: dp_shard x cp): cp ranks hold the same weights (process_group.shard_mesh)
    state = mm.model_state(split["trainable"] - experts, p.grid.shard_size * p.cp, p.zero, precision_layout(spec),
                           name, momentum=o.momentum > 0, fsdp=True, zero3_gathered_params=gathered,
                           offload_optimizer=offload["optimizer"], offload_params=offload["params"],
                           host_master=p.device != "cpu", frozen=split["frozen"],
                           quantized_bytes=math.ceil(mm.NF4_BYTES_PER_WEIGHT * split["nf4"]), **steps)
    if o.name == "muon":  # the embeddings and head step with AdamW: 4 bytes each beyond Muon's one buffer
        state = replace(state, optimizer=state.optimizer + math.ceil(4 * root / (p.grid.shard_size * p.cp
                                                                                   if p.zero else 1)))
    if experts:  # this rank's routed experts: reduced and ZeRO-sharded over the dp * cp / ep ranks holding them
        layer = max(moe_params(spec, i)[2] for i in range(spec.model.n_layers)) // expert_split(spec)  # gathered
        own = mm.model_state(experts, p.dp * p.cp // p.ep, p.zero, precision_layout(spec), _adamw_if_muon(name),
                             momentum=o.momentum > 0, fsdp=True, zero3_gathered_params=layer,
                             offload_optimizer=offload["optimizer"], offload_params=offload["params"],
                             host_master=p.device != "cpu", **steps)
        state = mm.ModelState(*(a + b for a, b in zip(astuple(state), astuple(own))))
    if p.grid.tp_enabled and p.zero < 2 and 0 in ids and spec.model.lora is None:
        extra = mm.tp_embedding_grad_bytes(spec.padded_vocab_size, spec.model.d_model, p.tp)
        state = replace(state, grads=state.grads + extra)
    return state


def stepped_optimizer(spec: JobSpec) -> str:
    """The optimizer whose state the step holds: paged_adamw with ``memory.offload.page_at`` is AdamW on the
    device, paged out only under pressure (workers/offload/paged.py), so the fit check counts its state there."""
    o = spec.optim
    return "adamw" if o.name == "paged_adamw" and spec.memory.offload.page_at is not None else o.name


def _adamw_if_muon(name: str) -> str:
    """The optimizer a 3-D expert stack steps with: AdamW under muon (workers/optim/muon.py), else the job's."""
    return "adamw" if name == "muon" else name


def accumulates(spec: JobSpec) -> bool:
    """Whether gradients build up over several microbatches before they are reduced (pipelines always do)."""
    return spec.train.microbatches > 1 or spec.parallel.grid.pp_enabled


def grads_at_activation_peak(spec: JobSpec, pp_rank: int, stages: int) -> bool:
    """Whether some microbatch's backward has run when this rank's saved activations peak (``mm.carries_grads``)."""
    p, mbs = spec.parallel, spec.train.microbatches
    in_flight = mm.in_flight_microbatches(p.pp_schedule, p.pp, pp_rank, mbs, stages)
    return mm.carries_grads(p.grid.pp_enabled, in_flight, mbs, stages)


def freed_in_backward(spec: JobSpec, saved: int, pp_rank: int, ids: list[int]) -> int:
    """Activations backward frees before it gathers parameters again (``mm.freed_first``)."""
    p = spec.parallel
    in_flight = mm.in_flight_microbatches(p.pp_schedule, p.pp, pp_rank, spec.train.microbatches, len(ids))
    head = head_bytes(spec) if p.n_stages - 1 in ids else 0
    return mm.freed_first(saved, in_flight, p.grid.pp_enabled, head)


def regathers(spec: JobSpec) -> bool:
    """Whether ZeRO-3 reshards after forward and gathers again in backward: FSDP2 does on a mesh of more than
    one rank, and its mesh is dp x cp (``data_parallel_mesh``), so cp ranks alone reshard too."""
    return spec.parallel.zero >= 3 and spec.parallel.dp * spec.parallel.cp > 1


def recompute_working_bytes(spec: JobSpec, layers: list[int]) -> int:
    """Under full recompute, backward rebuilds one block's activations at a time: the largest of this
    rank's blocks as if nothing were recomputed (selective rebuilds only the attention core: left out). Under
    ``sqrt`` it rebuilds one segment at a time: the largest of this rank's segments (Chen et al.'s O(ℓ/d) term)."""
    if spec.memory.recompute not in ("full", "sqrt") or not layers:
        return 0
    length = recompute_plan("sqrt", 1, spec.model.n_layers)[1] if spec.memory.recompute == "sqrt" else 1
    segments: dict[int, int] = {}
    for i in layers:
        segments[i // length] = segments.get(i // length, 0) + layer_bytes(spec, i, recompute="none")
    return max(segments.values())


def estimate_rank(spec: JobSpec, rank: int) -> RankEstimate:
    p = spec.parallel
    coords = p.grid.coords_dict(rank)
    n_stages, ids = own_stages(p, coords["pp"])
    params = 0
    for sid in ids:
        sharded, replicated = stage_params(spec, sid, n_stages)
        params += sharded // p.tp + replicated
    experts = sum(stage_expert_params(spec, sid, n_stages) for sid in ids) // expert_split(spec)
    params += experts
    split = {**rank_parameter_split(spec, params, ids, n_stages), "experts": experts}
    saved = rank_saved_activation_bytes(spec, ids, coords["pp"])
    largest = max(layer_bytes(spec, i) for i in range(spec.model.n_layers))
    masks = rank_mask_bytes(spec, ids, coords["pp"])  # kept on the device by activation offload
    head = head_bytes(spec) if n_stages - 1 in ids else 0
    on_device = mm.device_activation_bytes(saved - masks, largest, offload_flags(spec)["activations"], head) + masks
    layers = [i for sid in ids for i in stage_layers(spec, sid, n_stages)]
    return RankEstimate(rank, coords, ids, params, rank_model_state(spec, split, ids, n_stages), on_device,
                        buffer_bytes(spec, params, ids, split["trainable"], coords["pp"]), saved - on_device,
                        grads_at_activation_peak(spec, coords["pp"], len(ids)), recompute_working_bytes(spec, layers),
                        freed_in_backward(spec, saved, coords["pp"], ids), regathers(spec),
                        error_feedback_bytes(spec, split["trainable"]), loss_bytes(spec, ids))


def stage_estimates(spec: JobSpec) -> list[RankEstimate]:
    """The estimate of each pipeline coordinate's first rank, in rank order. Ranks that share a pipeline
    coordinate hold the same bytes (their dp, cp and tp coordinates enter no term), so questions about the
    largest rank are answered here, without the copy per rank ``estimate`` makes (16,384 of them for Llama 3
    405B on 2,048 nodes, a tenth of a second each time ``raymesh plan`` asked)."""
    grid = spec.parallel.grid
    return [estimate_rank(spec, grid.rank_of(pp=pp)) for pp in range(grid.pp)]


def estimate(spec: JobSpec) -> list[RankEstimate]:
    """Every rank's estimate: its pipeline coordinate's (``stage_estimates``), copied, so 16,384 ranks of
    Llama 3 405B cost 16 estimates, not minutes."""
    grid, by_pp = spec.parallel.grid, stage_estimates(spec)
    out = []
    for rank in grid.ranks():
        coords = grid.coords_dict(rank)
        out.append(replace(by_pp[coords["pp"]], rank=rank, coords=coords))
    return out


def peak_rank(spec: JobSpec) -> RankEstimate:
    """The rank with the largest peak, the lowest of equals (as over ``estimate``'s every rank)."""
    return max(stage_estimates(spec), key=lambda r: r.total_bytes)


def render(spec: JobSpec, one_per_stage: bool = False) -> str:
    """The per-rank table; ``one_per_stage`` keeps one rank per pp coordinate (dp, cp and tp peers are alike)."""
    p = spec.parallel
    rows = stage_estimates(spec) if one_per_stage else estimate(spec)  # each stage's first rank: dp=cp=tp=0
    lines = [
        f"job {spec.name}: {' x '.join(f'{a}={n}' for a, n in zip(p.grid.mesh_dims, p.grid.mesh_shape))} = "
        f"{p.world_size} ranks, zero={p.zero}, " + (f"cp_impl={p.cp_impl}, " if p.grid.cp_enabled else "") +
        (f"schedule={p.pp_schedule} ({p.stages_per_rank} stage(s)/rank), " if p.pp > 1 else "") +
        f"precision={spec.precision.dtype}{precision_note(spec)}, "
        f"recompute={spec.memory.recompute}"
        + (f", loss_chunks={spec.train.loss_chunks}" if spec.train.loss_chunks > 1 else ""),
        f"{'rank':>4} {'dp':>3} {'pp':>3} " + (f"{'cp':>3} " if p.grid.cp_enabled else "") +
        f"{'tp':>3} {'stages':>8} {'params':>12} {'weights':>10} {'grads':>10} "
        f"{'optim':>10} {'gathered':>10} {'activ':>10} {'buffers':>10} {'total':>10}",
    ]
    if p.n_stages > 1:
        lines.insert(1, split_line(spec))
    for r in rows:
        s = r.state
        lines.append(
            f"{r.rank:>4} {r.coords['dp']:>3} {r.coords['pp']:>3} "
            + (f"{r.coords['cp']:>3} " if p.grid.cp_enabled else "") + f"{r.coords['tp']:>3} "
            f"{','.join(map(str, r.stages)):>8} {r.params:>12,} "
            + " ".join(_mib(n) for n in (s.params, s.step_grads, s.optimizer, s.gathered, r.activation_bytes,
                                          r.buffer_bytes, r.total_bytes))
        )
    offloaded = max(r.state.offloaded for r in rows)
    if offloaded:
        off = spec.memory.offload
        stored = off.optimizer or stepped_optimizer(spec) == "paged_adamw"
        what = [name for name, on in (("parameter shards", off.params), ("optimizer state", stored)) if on]
        lines.append(f"offloaded to the {off.tier} store, not counted above: up to {_mib(offloaded).strip()} a rank "
                     f"({' + '.join(what)})")
    return "\n".join(lines)


def split_line(spec: JobSpec) -> str:
    """The layers per stage the ranks will build; for ``pp_split: auto`` also the profiled costs it came from."""
    if spec.parallel.pp_split == "auto":
        return auto_split(spec).describe()
    return f"pp_split {list(spec.stage_split)} layers per stage"


def _mib(n: int) -> str:
    return f"{n / 2**20:>8.2f}Mi"
