"""An MoE job's expert terms in bytes and parameters: what an MoE block holds, routes, saves and buffers.

Why apart from ``estimate``: the layout search (``layout_search.Moe``) prices them for every micro-batch size
without a spec per layout, and ``estimate`` builds on ``layout_search``; both read them from here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from orchestrator.planning import memory_model as mm

if TYPE_CHECKING:
    from orchestrator.spec import JobSpec

# feed-forward matrices per block: GPT's up/down, Llama's (and DeepSeek-V3's) gate/up/down (an hf model, any
# transformers causal LM, is estimated as GPT-2 and Phi are: up/down)
FFN_MATRICES = {"gpt": 2, "llama": 3, "deepseek_v3": 3, "gpt_oss": 3, "hf": 2}
CAPACITY_ROUTERS = ("gshard", "switch")  # token-choice routers that drop assignments over capacity


def _micro_batch(spec) -> int:
    """Sequences per microbatch (``estimate.micro_batch``, which imports this module)."""
    return spec.train.global_batch_size // spec.parallel.dp // spec.train.microbatches


def moe_params(spec: JobSpec, layer: int) -> tuple[int, int, int]:
    """Block ``layer``'s (dense feed-forward it replaces, router + shared experts, routed experts); zeros for a
    dense block. Routed experts are what expert parallelism splits over ``parallel.ep``."""
    m, moe = spec.model, spec.model.moe
    if moe is None or not m.is_moe_layer(layer):
        return 0, 0, 0
    width = moe.d_expert or m.ffn_dim
    ffn = FFN_MATRICES[m.arch] * m.d_model * width + (2 * width + m.d_model if m.arch == "gpt_oss" else 0)  # biases
    router = m.d_model * moe.experts * (2 if moe.router == "noisy_topk" else 1)  # noisy top-k: W_g and W_noise
    router += moe.experts if m.arch == "gpt_oss" else 0  # its router's bias
    router += m.d_model * (moe.expert_groups or 0) if moe.router == "hierarchical" else 0  # its group gate
    return FFN_MATRICES[m.arch] * m.d_model * m.ffn_dim, router + moe.shared_experts * ffn, moe.experts * ffn


def routed_rows(spec: JobSpec, mbs: int | None = None) -> int:
    """Token copies one MoE layer sends to its experts for one microbatch (of ``mbs`` sequences; default: the
    job's): tokens × top_k (dropless), capped at each group's expert capacity (gshard, switch:
    ``MoEConfig.capacity`` per expert and group), or every expert's k = n·c/e tokens of each group (expert_choice)."""
    m, moe = spec.model, spec.model.moe
    tokens = m.seq_len * (mbs or _micro_batch(spec))
    n = m.seq_len if moe.group == "sequence" else tokens  # tokens of one routing group
    groups = tokens // n
    if moe.router == "expert_choice":
        return groups * moe.experts * max(1, min(n, int(n * moe.capacity_factor / moe.experts)))
    if moe.router in CAPACITY_ROUTERS:
        return groups * min(n * moe.k, moe.experts * moe.capacity(n, moe.k))
    return tokens * moe.k


def moe_activation_bytes(spec: JobSpec, mbs: int | None = None) -> int:
    """What one MoE feed-forward saves for backward for one microbatch (of ``mbs`` sequences; default: the job's,
    as the layout search asks for each micro-batch size it prices), beyond the block's attention half.

    Replicated over tp (``workers.parallel.gpt_parallel.moe_style``), so whole-microbatch sized under any tp, with
    T tokens, A = ``routed_rows`` token copies, c the compute bytes, h the expert width, E experts:
    the router's float32 input (T·d), its float32 probabilities (T·E; the z-loss's logsumexp keeps the logits,
    noisy top-k its noisy and noise-scale scores too) and per choice (T·k) its int64 index, float32 gate and
    renormalised gate and kept mask; the gathered rows each expert's first matmul keeps (A·d, one low-precision
    copy per matmul reading them under autocast), its hidden activations (A·h, 2 tensors, 4 for SwiGLU, and
    expert dropout's mask), the expert outputs the gate multiply keeps (A·d) and the gate-weighted ones the
    combining ``index_add`` keeps (A·d, in the input's float32), gates and the int64 token/order indices (A
    each); shared experts as dense feed-forwards over all T tokens. Checked against measured saved tensors by
    ``tests/integration/test_moe_memory.py``.
    """
    m, moe = spec.model, spec.model.moe
    c, d, h = mm.BYTES_PER[spec.precision.dtype], m.d_model, moe.d_expert or m.ffn_dim
    h_routed = h // expert_tp(spec)  # expert tensor parallelism: a tp rank's slice of each routed expert
    tokens, rows = m.seq_len * (mbs or _micro_batch(spec)), routed_rows(spec, mbs)
    glu = FFN_MATRICES[m.arch] == 3
    casts = (2 if glu else 1) if c < 4 else 1  # copies of an expert's input rows its matmuls keep
    scores = 1 + (moe.z_loss_weight > 0) + (2 if moe.router == "noisy_topk" else 0)
    router = 4 * tokens * d + 4 * tokens * moe.experts * scores + tokens * moe.k * (8 + 4 + 4 + 1)
    hidden = (4 if glu else 2) + (moe.expert_dropout > 0)  # expert dropout keeps its mask
    per_row = c * (casts * d + hidden * h_routed + d) + 4 * d + 4 + 3 * 8
    shared = moe.shared_experts * tokens * c * ((4 if glu else 2) * h + (casts * d if c < 4 else 0))
    return router + rows * per_row + shared


def expert_tp(spec: JobSpec) -> int:
    """Over how many tp ranks each routed expert is split: tp under ``parallel.expert_tp``, else 1."""
    return spec.parallel.tp if spec.parallel.expert_tp else 1


def all_to_all_bytes(spec: JobSpec, mbs: int | None = None) -> int:
    """Expert parallelism's transient buffers: one MoE layer's dispatch and combine, each a send and a receive
    buffer of the microbatch's routed rows (tokens × k, d_model wide) at the compute precision (``mbs``: as
    ``moe_activation_bytes``; given, the buffers the job would hold at ep > 1 whatever its own ep)."""
    m, moe = spec.model, spec.model.moe
    if moe is None or (mbs is None and not spec.parallel.grid.ep_enabled):
        return 0
    rows = m.seq_len * (mbs or _micro_batch(spec)) * (moe.k if moe.router != "expert_choice" else moe.capacity_factor)
    return math.ceil(4 * rows * m.d_model * mm.BYTES_PER[spec.precision.dtype])
