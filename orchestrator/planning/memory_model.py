"""Per-rank memory model: bytes of model state, activations and buffers, as pure arithmetic.

No torch, no spec: every function takes plain numbers so the planner, the CLI,
tests and notebooks can ask "what if" without building anything. The planner
(``orchestrator.planning.estimate``) maps a job spec onto these functions.

Model state follows the ZeRO paper's accounting (seed articles 003/004):
``(2 + 2 + K)·Ψ`` bytes for Ψ parameters in mixed precision, K = 12 for Adam
(fp32 master 4 + momentum 4 + variance 4); ZeRO-1 divides the optimizer state
by the data-parallel degree N, ZeRO-2 the gradients too, ZeRO-3 the parameters
too. Three precision layouts:

- ``mixed``: the paper's (DeepSpeed/Megatron): 16-bit parameters and gradients,
  fp32 master weights counted in the optimizer state.
- ``fp32``: everything in fp32, no master copy (4 + 4 + K_opt).
- ``autocast``: what raymesh runs for ``precision.dtype: bf16|fp16`` under ``torch.autocast``: fp32
  parameters, gradients and optimizer state (so the same state bytes as fp32; only activations shrink).
- ``fsdp_mixed``: bf16 through FSDP2's mixed-precision policy (``workers/contract/mixed_precision.py``): the
  same fp32 state, but the parameters all-gathered for compute are bf16 (half the ``gathered`` term).

``fsdp=True`` models ZeRO-2/3 as raymesh runs them (FSDP2): the persistent
parameter copy is sharded for ZeRO-2 as well, and parameters are all-gathered
for compute into a transient ``gathered`` term: the whole stage for ZeRO-2
(``reshard_after_forward=False`` keeps it from forward through backward), the
root unit with the current and the prefetched block for ZeRO-3. The paper's tables use
``fsdp=False``, where ZeRO-2 keeps 16-bit parameters replicated.

ZeRO-0 and ZeRO-1 over more than one rank reduce through a flat copy of the gradients (``reducing``,
``reduction_bytes``): ZeRO-0's buckets (``workers/parallel/grad_buckets.py``: each bucket's flat copy lives from
its launch, late in backward, until ``finish``) and ZeRO-1's reduce-scatter buffer and gradient slices
(``distributed_optimizer.py``, after backward). They exist only once backward has produced the gradients, when
the activations are gone, so they join the end-of-backward moment of ``in_step_peak``, not the whole step
(measured with torch's ``MemTracker`` at dp=2, ``tests/unit/test_zero_reduction_memory.py``: ZeRO-0 counted as an
unsharded parameter copy all step, which ``replicate()`` made and the buckets that replaced it do not, was
+15.5%, +18.2% at tp=2; ZeRO-1's buffer counted on top of the activations hid its own under-count).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from orchestrator.spec.sections import recompute_plan
from workers.contract.schedules import schedule as schedule_facts

# Optimizer state bytes per parameter beyond any fp32 master copy (the paper's K minus 4).
# adafactor (factored second moment, no first moment by default) and sm3 (one accumulator
# per row and per column) keep O(rows + cols) per matrix: ~0 per parameter at scale.
# onebit_adam: AdamW's two moments; its error feedback is not optimizer state (``estimate.error_feedback_bytes``)
# muon: one momentum buffer per block matrix (workers/optim/muon.py); its AdamW share (embeddings, head, norms,
# experts) is counted at AdamW's 8 by ``estimate.rank_model_state``
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "paged_adamw": 8, "onebit_adam": 8, "sgd": 0, "adafactor": 0,
                         "sm3": 0, "muon": 4}
# optimizers whose two moments take optim.state_dtype's width (the spec refuses bf16 state for the others)
LOW_PRECISION_STATE_OPTIMIZERS = frozenset({"adam", "adamw"})
# optimizers whose state lives in the offload store, not on the device
HOST_STATE_OPTIMIZERS = frozenset({"paged_adamw"})
# param, grad, master bytes; fsdp_mixed: FSDP2's bf16 policy keeps fp32 shards (the optimizer's masters) and
# gathers bf16 copies for compute (``GATHERED_BYTES``)
PRECISIONS = {"fp32": (4, 4, 0), "autocast": (4, 4, 0), "mixed": (2, 2, 4), "fsdp_mixed": (4, 4, 0)}
GATHERED_BYTES = {"fsdp_mixed": 2}  # bytes per all-gathered parameter where not the persistent width
BYTES_PER = {"fp32": 4, "bf16": 2, "fp16": 2}
# QLoRA's NF4 weight (workers.model.nf4): 4-bit codes, an int8 absmax per 64 weights, an fp32 step per 256 absmaxes
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 4 / (64 * 256)


@dataclass(frozen=True)
class ModelState:
    """Per-rank model-state bytes on the device; ``offloaded`` is what moved to host/NVMe."""

    params: int
    grads: int
    optimizer: int
    gathered: int = 0  # transient: unsharded parameters during compute (FSDP2 ZeRO-2/3)
    offloaded: int = 0
    accumulating: int = 0  # transient: full-size gradients beyond ``grads`` held until the last microbatch
    reducing: int = 0  # transient, after backward: ZeRO-0/1's flat copy of the gradients being reduced

    @property
    def step_grads(self) -> int:
        """Gradient bytes at their in-step high point (the sharded ones plus any held unsharded)."""
        return self.grads + self.accumulating

    @property
    def persistent(self) -> int:
        """What lives on the device across steps (what a probe counts after a step)."""
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        return self.persistent + self.gathered

    def as_dict(self) -> dict:
        return {**asdict(self), "persistent": self.persistent, "peak": self.peak, "step_grads": self.step_grads}


def in_step_peak(state: ModelState, activations: int, grads_at_activation_peak: bool = False,
                 regathers: bool = False, freed: int = 0, working: int = 0, loss: int = 0) -> int:
    """Model state plus activations at the step's high point (buffers aside; see ``RankEstimate.total_bytes``).

    Weights and optimizer state are there all step; the rest peaks at one of three moments (measured with
    the probe's in-step sampling, ``ActivationMeter.step_peak``):

    - the end of forward, through the loss backward: all saved ``activations``, the gradients of earlier
      microbatches (``grads_at_activation_peak``), the gathered parameters, unless ZeRO-3 resharded them
      after forward (``regathers``; FSDP2 reshards the root too), and on the head's rank the loss's transient
      gradients (``loss``: ``loss_backward_bytes``, which the probe does not see and a GPU's allocator does);
    - backward, once it has ``freed`` the first activations it consumes (the head's; in a pipeline one
      microbatch's): the parameters gathered again and recompute's rebuilt block (``working``);
    - the end of backward: every gradient, the gathered parameters and ZeRO-0/1's flat copy of the gradients
      for their reduction (``reducing``), the activations gone.
    """
    grads = state.step_grads
    carried = grads if grads_at_activation_peak else 0
    forward_end = activations + carried + (0 if regathers else state.gathered) + loss
    in_backward = activations - freed + carried + state.gathered + working
    backward_end = grads + state.gathered + state.reducing
    return state.params + state.optimizer + max(forward_end, in_backward, backward_end)


def optimizer_state_bytes(optimizer: str, momentum: bool = False, state_dtype: str = "fp32") -> int:
    """K_opt: state bytes per parameter (SGD keeps a 4-byte buffer only with momentum; adam/adamw's two moments
    take 2 bytes each under ``optim.state_dtype: bf16``, workers/optim/state_dtype.py)."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATE_BYTES)}")
    if optimizer in LOW_PRECISION_STATE_OPTIMIZERS:
        return 2 * BYTES_PER[state_dtype]
    return 4 if optimizer == "sgd" and momentum else OPTIMIZER_STATE_BYTES[optimizer]


def zero3_gathered_params(root: int, block: int, tp: int, fsdp_prefetch: int) -> int:
    """Parameters a ZeRO-3 rank holds gathered at once on FSDP2: the root unit (embeddings, head) from forward
    through backward, the block being computed, and the blocks gathered ahead of it (FSDP2's one, or
    ``parallel.fsdp_prefetch`` of them when more), each split over ``tp``."""
    return (root + (1 + max(1, fsdp_prefetch)) * block) // tp


def model_state(n_params: int, dp: int = 1, zero: int = 0, precision: str = "fp32", optimizer: str = "adamw",
                momentum: bool = False, fsdp: bool = False, zero3_gathered_params: int = 0,
                offload_optimizer: bool = False, offload_params: bool = False,
                host_master: bool = False, frozen: int = 0, quantized_bytes: int = 0,
                accumulating: bool = False, pipelined: bool = False, gloo: bool = False,
                state_dtype: str = "fp32") -> ModelState:
    """Model-state bytes of one rank holding ``n_params`` (its pipeline/TP share) under ZeRO ``zero`` over ``dp``.

    ``zero3_gathered_params``: parameters all-gathered at once at ZeRO-3's peak (FSDP2:
    the root unit plus the block being computed and the one prefetched). ``offload_optimizer`` (ZeRO-Offload)
    moves the optimizer state, master weights included, off the device;
    ``host_master``: the offloaded step keeps an fp32
    master beside the moments even where the precision layout has none, because the device's
    parameters are not host fp32 tensors (``workers.offload.optimizer.needs_master``: on a GPU).
    ``offload_params`` (ZeRO-Infinity, needs ZeRO-3) moves the persistent parameter shards off
    too, so only gathered units stay.
    ``frozen``: parameters beside ``n_params`` that train not (LoRA's base): weights only,
    sharded like the rest; ``quantized_bytes``: frozen weights stored quantized (QLoRA's NF4)
    as module buffers, which ZeRO does not shard.
    Gradients stay on the device (they are produced there; an offload store may
    stream them out, which this model does not count as a saving).

    ``accumulating`` (several microbatches, or any pipeline): FSDP2 skips the reduce-scatter
    until the last microbatch (``set_requires_gradient_sync(False)``), so ZeRO-2/3 hold full-size
    gradients meanwhile (the ``accumulating`` term). ``pipelined``: torch's ``PipelineStage`` also
    turns off resharding after backward, so under ZeRO-3 the whole stage's parameters stay
    gathered, as under ZeRO-2. ``gloo`` (a CPU job): gloo runs ZeRO-1's ``reduce_scatter_tensor`` through a
    full-size copy of its input (measured at dp=2; NCCL reduce-scatters without one). ``state_dtype``:
    ``optim.state_dtype``, the width of adam/adamw's moments.
    """
    p_bytes, g_bytes, master = PRECISIONS[precision]
    k = master + optimizer_state_bytes(optimizer, momentum, state_dtype)
    params, grads, optim = p_bytes * (n_params + frozen), g_bytes * n_params, k * n_params
    gathered = 0
    if zero >= 1:
        optim = math.ceil(optim / dp)
    if zero >= 2:
        grads = math.ceil(grads / dp)
    width = GATHERED_BYTES.get(precision, p_bytes)
    if zero >= 3 or (fsdp and zero == 2):
        params = math.ceil(params / dp)
        if fsdp and (dp > 1 or precision in GATHERED_BYTES):  # a 16-bit gather is a copy even on one rank
            whole_stage = zero == 2 or pipelined
            gathered = width * (n_params + frozen if whole_stage else min(zero3_gathered_params, n_params + frozen))
    reducing = reduction_bytes(g_bytes * n_params, dp, zero, gloo) if zero <= 1 else 0
    held = g_bytes * n_params - grads if accumulating and zero >= 2 and dp > 1 else 0
    params += quantized_bytes
    offloaded = 0
    if offload_optimizer or optimizer in HOST_STATE_OPTIMIZERS:
        extra_master = 4 * n_params if host_master and not master else 0
        offloaded, optim = optim + (math.ceil(extra_master / dp) if zero >= 1 else extra_master), 0
    if offload_params:
        offloaded, params = offloaded + params, 0
    return ModelState(params, grads, optim, gathered, offloaded, held, reducing)


def reduction_bytes(grad_bytes: int, dp: int, zero: int, gloo: bool = False) -> int:
    """ZeRO-0/1's transient bytes for reducing ``grad_bytes`` of gradients over ``dp`` ranks (module docstring):
    the flat copy of every gradient (ZeRO-0's buckets, ZeRO-1's reduce-scatter input, twice on gloo), and under
    ZeRO-1 this rank's slice of the average, the sliced optimizer's gradients until the step ends."""
    if dp == 1:
        return 0
    if zero == 0:
        return grad_bytes
    return grad_bytes * (2 if gloo else 1) + math.ceil(grad_bytes / dp)


def max_trainable_params(device_bytes: float, dp: int, zero: int, precision: str = "mixed",
                         optimizer: str = "adamw", activation_reserve: float = 0.3) -> int:
    """Largest Ψ whose model state fits ``device_bytes`` after reserving a fraction for activations.

    The seed article's chart (80 GB GPUs: about 3.5B under DDP at any scale, linear
    growth under ZeRO-3) keeps ~30% of the device for activations and fragmentation:
    0.7 · 80 GB / 16 B = 3.5B.
    """
    per_param = model_state(1_000_000, dp, zero, precision, optimizer).persistent / 1_000_000
    return int(device_bytes * (1 - activation_reserve) / per_param)


# ------------------------------------------------------------------------------------ activations


ALL_LINEARS = frozenset({"wq", "wk", "wv", "wo", "w1", "w2"})


@dataclass(frozen=True)
class Frozen:
    """A block (or the head) of a LoRA run: frozen base, adapters of ``rank`` on the Linears named in ``adapted``.

    Autograd saves only what some gradient needs (measured with ``workers.diagnostics.memory_probe``):
    a frozen Linear saves nothing (its input would only serve its own weight gradient)
    but its adapter's A saves that input and B saves A's rank-r output; a frozen norm
    saves its input (for the input gradient) but not the normalised x (only its weight
    gradient reads that); and nothing needs a gradient upstream of the first adapter
    (the embedding is frozen), so ``input_grad`` is False there and ops whose inputs
    need no gradient save nothing at all.
    """

    adapted: frozenset = frozenset()
    rank: int = 0
    input_grad: bool = True

    def output_grad(self) -> bool:
        """Whether the block's output needs a gradient (what the next block sees as ``input_grad``)."""
        return self.input_grad or bool(self.adapted)


def layer_recompute(policy: str, every: int, layer: int, n_layers: int = 1) -> str:
    """The recompute policy block ``layer`` runs under with ``memory.recompute_every: every``: ``policy`` on
    layers whose global index is a multiple of ``every`` (``workers.parallel.recompute``), none on the others;
    ``sqrt`` as ``recompute_plan`` resolves it for ``n_layers`` blocks: a segment's first block keeps its input
    (as ``full`` does), the others (``segment``) nothing until backward recomputes the segment."""
    policy, every = recompute_plan(policy, every, n_layers)
    if policy == "sqrt":
        return "full" if layer % every == 0 else "segment"
    return policy if layer % every == 0 else "none"


def layer_activation_bytes(seq: int, micro_batch: int, d_model: int, n_heads: int, ffn_dim: int,
                           tp: int = 1, sequence_parallel: bool = False, recompute: str = "none",
                           compute_bytes: int = 4, attention: str = "flash", frozen: Frozen | None = None,
                           kv_heads: int | None = None, family: str = "gpt", fsdp_mixed: bool = False,
                           head_dim: int | None = None, fused_norm: bool = False, compiled: bool = False) -> int:
    """Bytes one transformer block saves for backward for one microbatch (raymesh's GPT or Llama block).

    Counted tensor by tensor from what autograd keeps (the probe checks it), with
    s·b·h = seq · micro_batch · d_model elements and c = ``compute_bytes``:

    - residual input x and the RMSNorm's normalised x, twice (attention and FFN
      norms): 4 tensors in fp32 (norms compute in float32 whatever autocast says);
      sharded over tp along the sequence under sequence parallelism, else full.
    - each norm's output as the column-parallel linears see it: c bytes, full sequence (sequence
      parallelism all-gathers before the linear); once in fp32, but under autocast once per Linear
      reading it (each casts its own copy: q, k, v three; GPT's FFN one, Llama's gate and up two).
    - attention: rotated q, rotated k, v and the attention output: 4 tensors of c
      bytes sharded by heads over tp, q and the output n_heads·head_dim wide (``head_dim``: d_model/n_heads
      unless given, Qwen3's wider heads), k and v kv_heads·head_dim; the SDPA kernel's log-sum-exp (b·a·s fp32);
      ``attention="math"`` (explicit softmax) adds scores and probabilities,
      2·c·b·a·s², Korthikanti's 5as/h term without dropout.
    - MLP: the first linear's output and GELU's output, 2 tensors of b·s·ffn at c
      bytes, sharded by tp.
    - Llama (``family="llama"``): the SwiGLU keeps 4 tensors of b·s·ffn (gate output, its silu, up output,
      their product) instead of 2; its half-rotation keeps half-width cos/sin tables, as the GPT's pairs do.
    - small: two rsqrt outputs (b·s fp32) and rotary cos/sin tables (4 · s·head_dim/2 fp32).

    Recompute: ``full`` keeps only the block input (4·s·b·h, fp32 residual, sequence-
    sharded under SP); ``selective`` recomputes the attention core, dropping what only
    the core saves (log-sum-exp, and the s² matrices of ``math`` attention).

    ``frozen`` (LoRA, see ``Frozen``) keeps of these only what a gradient needs, plus
    each adapter's rank-r A output (c·s·b·r, not sharded: A's output is whole on every tp rank).

    ``fsdp_mixed`` (FSDP2's bf16 policy, not autocast): weights and the residual stream already are c-byte
    tensors, so a norm's normalised x is saved at c bytes, its output once for every Linear reading it (nothing
    casts), and full recompute keeps a c-byte block input. A norm still saves its float32 copy of the input,
    except under ``fused_norm`` (a GPU's eager ``F.rms_norm``: one fused kernel that saves its input as it is,
    c bytes under the policy, and the rsqrt; on a CPU the same call runs as separate ops and keeps the copy).

    ``compiled`` (``train.compile``, blocks through inductor; measured on an H200, README "GPU"): Llama's
    SwiGLU keeps only the gate and up outputs (silu and the product are recomputed in backward), and the norms
    keep the float32 input copy as the separate ops do.
    """
    s, b, h, a = seq, micro_batch, d_model, n_heads
    sbh = s * b * h
    seq_shard = tp if sequence_parallel else 1
    f = frozen or Frozen(ALL_LINEARS, 0, True)
    trained = frozen is None
    x_grad, on = f.input_grad, f.adapted.__contains__
    residual = compute_bytes if fsdp_mixed else 4  # the stream between blocks: fp32 under autocast
    if recompute == "full":
        return residual * sbh // seq_shard if x_grad else 0
    llama = family == "llama"
    hd = head_dim or h // a
    kv = s * b * hd * (kv_heads or a)  # elements of k (and of v) for the microbatch
    sba = s * b * a * hd  # elements of q (and of the attention output)
    attn_grad = x_grad or any(map(on, ("wq", "wk", "wv")))
    mid_grad = attn_grad or on("wo")
    up_adapted = on("w1") or on("w3")
    h1_grad = mid_grad or up_adapted

    saved_input = residual if fused_norm and not compiled else 4

    def norm(grad: bool) -> int:  # input and rsqrt for the input gradient; normalised x for the weight's
        return ((saved_input * sbh + 4 * s * b) * grad + residual * sbh * trained) // seq_shard

    norms = norm(x_grad) + norm(mid_grad)
    linear_inputs = compute_bytes * sbh * (_copies(on, ("wq", "wk", "wv"), compute_bytes, fsdp_mixed)
                                           + _copies(on, ("w1", "w3") if llama else ("w1",), compute_bytes,
                                                     fsdp_mixed))
    attn = compute_bytes * ((sba + 2 * kv) * attn_grad + sba * (attn_grad or on("wo"))) // tp
    core = (4 * b * a * s // tp + (2 * compute_bytes * b * a * s * s // tp if attention == "math" else 0)) * attn_grad
    mlp_tensors = 2 * (h1_grad or on("w2")) if llama and compiled else (3 if llama else 1) * h1_grad + on("w2")
    mlp = compute_bytes * s * b * ffn_dim // tp * mlp_tensors
    rotary = 4 * 4 * s * hd // 2 * attn_grad
    adapters = compute_bytes * s * b * f.rank * len(f.adapted) * (not trained)
    return norms + linear_inputs + attn + mlp + rotary + adapters + (0 if recompute == "selective" else core)


def feed_forward_copies(family: str, compute_bytes: int, frozen: Frozen | None = None,
                        fsdp_mixed: bool = False) -> int:
    """Copies of the feed-forward norm's output ``layer_activation_bytes`` counts for the MLP's first linears
    (what an MoE feed-forward, which keeps its own, replaces)."""
    f = frozen or Frozen(ALL_LINEARS, 0, True)
    return _copies(f.adapted.__contains__, ("w1", "w3") if family == "llama" else ("w1",), compute_bytes,
                   fsdp_mixed)


def _copies(adapted, linears: tuple[str, ...], compute_bytes: int, fsdp_mixed: bool = False) -> int:
    """How many copies of one norm output the ``linears`` reading it save: in fp32, or in bf16 under FSDP2's
    policy (nothing casts), they share the tensor (one copy); under autocast each Linear casts its input
    itself, and autograd keeps each cast (q, k and v: three low-precision copies; measured with the probe)."""
    n = sum(map(adapted, linears))
    return n if compute_bytes < 4 and not fsdp_mixed else min(n, 1)


def gathered_kv_bytes(seq: int, micro_batch: int, d_model: int, n_heads: int, kv_heads: int, cp: int, tp: int = 1,
                      compute_bytes: int = 4, head_dim: int | None = None) -> int:
    """What all-gather context parallelism adds to a block's saved activations: the gathered K/V of the whole
    sequence, every rank's block (this one's too) stacked in one tensor the kernel saves for backward, beside
    the local k and v ``layer_activation_bytes`` counts for ``seq / cp`` tokens."""
    return 2 * compute_bytes * micro_batch * seq * (head_dim or d_model // n_heads) * kv_heads // tp if cp > 1 else 0


def document_mask_bytes(seq: int, micro_batch: int, cp: int, impl: str, compute_bytes: int = 4) -> int:
    """What ``model.attention_mask: document`` adds to a pipeline chunk's saved activations per microbatch: nothing,
    on every layout. Attention within documents runs blockwise (``workers.model.attention_blocks``: the ring's
    tiles, ``blockwise_attention`` at cp=1 and under Ulysses), which saves what causal attention saves (q, k, v,
    the output and its log-sum-exp) and builds no ``[micro_batch, 1, q, seq]`` mask; the boolean masks of the tiles a
    document boundary crosses (``ROW_TILE`` squared bytes per sequence each, a few per boundary, dependent on the
    data) live on the microbatch's ``Documents`` outside autograd and are not counted. The arguments stay so a
    layout's figure can grow a bound on those without changing its callers."""
    return 0


def cp_buffer_bytes(impl: str, seq: int, micro_batch: int, d_model: int, n_heads: int, kv_heads: int, cp: int,
                    tp: int = 1, compute_bytes: int = 4, head_dim: int | None = None) -> int:
    """Transient buffers of one block's context-parallel attention (one block runs at a time), 0 at cp=1.

    - ring: the K/V block being computed on and the one arriving (2 x K/V of the local share); backward adds
      the travelling dK/dV pair (float32) and its successor.
    - ulysses: the all-to-all copies of q, k, v and the output (head-sharded, full sequence: the same
      elements as the local share), in and out.
    - allgather: the gathered K/V themselves are saved activations (``gathered_kv_bytes``); its backward
      reduces one full-sequence dK/dV pair.
    """
    if cp == 1:
        return 0
    local = seq // cp
    hd = head_dim or d_model // n_heads
    kv = micro_batch * local * hd * kv_heads // tp  # elements of the local k (and of v)
    q = micro_batch * local * hd * n_heads // tp
    if impl == "ring":
        return 2 * 2 * kv * compute_bytes + 2 * 2 * kv * 4
    if impl == "ulysses":
        return 2 * (2 * q + 2 * kv) * compute_bytes
    return 2 * kv * cp * 4


def head_activation_bytes(seq: int, micro_batch: int, d_model: int, vocab: int, tp: int = 1,
                          sequence_parallel: bool = False, compute_bytes: int = 4, frozen: Frozen | None = None,
                          fsdp_mixed: bool = False, loss_chunks: int = 1, fused_norm: bool = False) -> int:
    """Last stage: final norm (input and normalised x, fp32; the normalised x at c bytes under ``fsdp_mixed``,
    and under ``fused_norm`` the input too, as in ``layer_activation_bytes``), the output linear's input
    (c bytes, gathered), log-softmax output (fp32, full vocab: logits are replicated
    before the loss) and the int64 targets. ``frozen``: the output Linear is adapted
    when ``"output"`` is in ``frozen.adapted``; the norm keeps its input only. With ``loss_chunks`` > 1
    (``train.loss_chunks``) no log-softmax output is saved: each chunk's is recomputed in backward
    (``loss_backward_bytes``)."""
    s, b = seq, micro_batch
    seq_shard = tp if sequence_parallel else 1
    logprobs = 4 * s * b * vocab if loss_chunks == 1 else 0
    if frozen is None:
        normed = compute_bytes if fsdp_mixed else 4
        saved_input = normed if fused_norm else 4
        return ((saved_input + normed) * s * b * d_model + 4 * s * b) // seq_shard \
            + compute_bytes * s * b * d_model + logprobs + 8 * s * b
    adapted, logits_grad = "output" in frozen.adapted, frozen.output_grad()
    return (4 * s * b * d_model + 4 * s * b) * frozen.input_grad // seq_shard \
        + compute_bytes * s * b * (d_model + frozen.rank) * adapted + (logprobs + 8 * s * b) * logits_grad


def loss_backward_bytes(seq: int, micro_batch: int, vocab: int, loss_chunks: int = 1, head_grad: int = 0,
                        compiled: bool = False) -> int:
    """What the loss backward allocates beside the saved activations on the head's rank, before it frees any:
    cross entropy's gradient w.r.t. the log-probabilities (``nll_loss`` backward writes a dense s·b·V float32
    tensor) and log-softmax's w.r.t. the float32 logits (another), both live with the saved log-probabilities.
    Full vocabulary on every tp rank (the head's logits are replicated before the loss). Why it matters: at
    Llama's 128,256 words and 8K tokens that is 8.4 GB a microbatch, often the step's peak. It also covers
    the forward's own transient at the loss (the 16-bit logits and their float32 copy: 6 or 4 bytes a logit).
    With ``loss_chunks`` > 1 one chunk at a time (its largest: ``ceil(seq / loss_chunks)`` tokens a sequence):
    its recomputed log-probabilities and those two gradients, and its share of the head weight's gradient
    (``head_grad`` bytes) beside the sum autograd accumulates the chunks' shares in (measured by
    ``benchmarks/loss_chunks.py``: below ~d_model tokens that pair outweighs the logits chunking saves).
    ``compiled`` (the whole-logits loss through ``torch.compile``, ``workers.model.gpt.compiled_lm_loss``):
    inductor's fused backward writes no dense float32 gradients beside the saved activations; on an H200 the
    1B Llama's step peak fell by exactly those two tensors (README "GPU")."""
    if loss_chunks == 1:
        return 0 if compiled else 2 * 4 * seq * micro_batch * vocab
    return 3 * 4 * -(-seq // loss_chunks) * micro_batch * vocab + head_grad


def suggested_loss_chunks(vocab: int, d_model: int, seq: int) -> int:
    """A ``train.loss_chunks`` whose chunk's logits are about the size of the hidden state (vocab / d_model
    chunks, up to a power of two: Liger-Kernel's fused linear cross entropy splits its tokens by the same
    ratio), at most the tokens of a sequence."""
    return min(seq, 1 << max(0, math.ceil(math.log2(vocab / d_model))))


def embedding_activation_bytes(seq: int, micro_batch: int) -> int:
    """First stage: the embedding keeps its int64 token indices."""
    return 8 * seq * micro_batch


def device_activation_bytes(saved_bytes: int, largest_layer_bytes: int, offload_activations: bool = False,
                            head_bytes: int = 0) -> int:
    """What of ``saved_bytes`` stays on the device. Offloading saved tensors (saved_tensors_hooks that
    pack to host/NVMe) keeps only a layer being packed and one being prefetched back for backward, except
    on the rank holding the head (``head_bytes`` of its saved tensors): backward unpacks those first, and they
    stay back on the device through the loss backward while the last block's are prefetched (on an H200 the
    1B Llama's peak with activation offload was 19.6% over the estimate that left them out, README "GPU")."""
    if not offload_activations:
        return saved_bytes
    return min(saved_bytes, max(2 * largest_layer_bytes, head_bytes + largest_layer_bytes))


def in_flight_microbatches(schedule: str, pp: int, pp_rank: int, microbatches: int, stages_per_rank: int = 1) -> int:
    """Stage-microbatches whose activations a pipeline rank holds at its peak: the schedule table's rule
    (``Schedule.in_flight`` in workers.contract.schedules, which documents each schedule's peak)."""
    return schedule_facts(schedule).in_flight(pp, pp_rank, microbatches, stages_per_rank)


# ------------------------------------------------------------------------------------ one rank's terms
# What a rank's in-step peak reads besides model state and per-block activations, in plain numbers: the spec
# estimate (``estimate.estimate_rank``) and the layout search (``layout_search.Evaluator.rank_peak``) both derive
# their terms here, so the two cannot price a rank differently.


def head_copies(holds_head: bool, pipelined: bool, all_forwards_first: bool, microbatches: int) -> int:
    """Microbatches whose head activations (final norm, log-softmax) a rank holds at its peak: none off the last
    stage; all of them under a pipeline schedule that runs every forward first (GPipe); else one, as every other
    schedule runs a microbatch's loss backward right after its forward (measured on interleaved 1F1B: averaging
    the head into the chunks over-predicted by 30%)."""
    if not holds_head:
        return 0
    return microbatches if pipelined and all_forwards_first else 1


def rank_saved_bytes(chunks: int, n_chunks: int, in_flight: int, head: int, heads: int) -> int:
    """Saved for backward on a rank, before activation offload: its average chunk (``chunks`` bytes over its
    ``n_chunks`` stages, one microbatch each) times the chunk-microbatches in flight, plus ``heads`` heads."""
    return chunks * in_flight // n_chunks + head * heads


def carries_grads(pipelined: bool, in_flight: int, microbatches: int, n_chunks: int) -> bool:
    """Whether some microbatch's backward has run when the rank's saved activations peak: without a pipeline from
    the second microbatch on; in a pipeline when the schedule keeps fewer in flight than it runs (GPipe keeps all:
    it peaks before any backward)."""
    return in_flight < microbatches * n_chunks if pipelined else microbatches > 1


def freed_first(saved: int, in_flight: int, pipelined: bool, head: int) -> int:
    """Activations backward frees before it gathers parameters again: in a pipeline half of one microbatch's share
    of what the rank holds in flight (the stage's blocks are gathered one by one as backward frees theirs: measured
    between the ZeRO-3 pipeline's ranks); otherwise ``head``, the head's (the loss backward runs first)."""
    return saved // max(1, in_flight) // 2 if pipelined else head


def pipeline_edges(ids: list[int], n_stages: int) -> int:
    """Receive buffers per microbatch of a rank holding stages ``ids``: PyTorch's PipelineStage keeps one for a
    stage's input (all but the first stage) and one for its output's gradient (all but the last)."""
    return sum((sid != 0) + (sid != n_stages - 1) for sid in ids) if n_stages > 1 else 0


def tp_embedding_grad_bytes(vocab: int, d_model: int, tp: int) -> int:
    """What tensor parallelism adds to the first stage's gradients under ZeRO-0/1 (measured: DTensor gives the
    vocabulary-sharded embedding a gradient of the full vocabulary on every tp rank; FSDP2 reshards it): the fp32
    rows of the other tp ranks, 14% of the tiny model's gradients."""
    rows = vocab * d_model
    return 4 * (rows - rows // tp)
