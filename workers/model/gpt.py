"""Reference decoder-only GPT.

The model is written so that parallelism is applied from outside it (the
torchtitan way): layers live in a ``ModuleDict`` keyed by their global index,
so a pipeline stage keeps only its own layers and the parameter names stay the
same on every layout (which is what lets a DCP checkpoint reshard); the
embedding, final norm and output head may be ``None`` on stages that do not own
them; attention reshapes with ``-1`` heads so tensor parallelism can hand it
only the local heads.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from workers.model.attention_blocks import blockwise_attention
from workers.model.config import ModelConfig
from workers.model.documents import Documents
from workers.model.meta_init import fill
from workers.model.moe import MoELayer, moe_parameter, share_balance_pool
from workers.model.mtp import with_extra_loss
from workers.model.registry import ModelFamily, register


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised in float32 and cast back to ``x``'s dtype, then scaled: Hugging Face's Llama order (the
        weight multiplies the already-rounded bf16 value). ``F.rms_norm`` does the first part as one fused
        kernel on a GPU (as separate ops: eight elementwise kernels forward and a dozen backward; with the rotary
        change they cost the 1B Llama's eager step 11% on an H200, README "GPU"); the weight stays outside it to
        keep that order and the dtype promotion of a float32 weight under autocast."""
        return F.rms_norm(x, (x.shape[-1],), eps=self.eps) * self.weight


def token_positions(shard, seq: int, device: torch.device) -> torch.Tensor:
    """Global positions of the ``seq`` tokens a module sees: ``0..seq-1``, or under context parallelism the
    positions its ``context_shard`` (``workers.parallel.context_layout.ContextShard``) holds."""
    return torch.arange(seq, device=device) if shard is None else shard.positions(seq, device)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of ``x`` [batch, seq, heads, head_dim] by each token's global position.

    Computed from the positions on the fly rather than from a buffer, so
    no pipeline stage or TP plan has to carry or shard a frequency table.
    """
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim))
    angles = torch.outer(positions.to(torch.float32), inv_freq)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class CausalCore(nn.Module):
    """Parameter-free attention core: a separate module so selective recompute can wrap just it, and the one
    place context parallelism enters attention (its ``context_shard``, set by the builder when cp > 1) and
    document masking (its ``documents``, set per microbatch: ``workers.model.documents.attending``), and a sliding
    ``window`` (``model.sliding_window``, fixed at build)."""

    reads_documents = True  # ``attending`` sets ``documents`` on it

    def __init__(self, window: int | None = None) -> None:
        super().__init__()
        self.context_shard = None
        self.documents: Documents | None = None  # None: plain causal attention
        self.window = window  # None: the whole causal prefix

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.context_shard is not None:
            return self.context_shard.attend(q, k, v, **self.document_kwargs())
        if self.window is not None or self.documents is not None:
            return blockwise_attention(q, k, v, self.documents, self.window)
        return self.local(q, k, v)

    def document_kwargs(self) -> dict:
        """What a context-parallel kernel is told of the documents and the window: nothing when attention is
        plainly causal."""
        documents = {} if self.documents is None else {"documents": self.documents}
        return documents if self.window is None else {**documents, "window": self.window}

    def masking(self, q: torch.Tensor) -> dict:
        """SDPA's mask arguments for a whole sequence ``q`` [batch, heads, seq, head_dim]: causal. Documents and
        windows never reach SDPA (``forward`` sends them blockwise), so no dense mask is built."""
        return {"is_causal": True}

    def local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over the sequence this rank holds whole."""
        return F.scaled_dot_product_attention(q, k, v, **self.masking(q))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_size
        self.rotary = cfg.positions == "rotary"
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.core = CausalCore()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        if self.rotary:
            positions = token_positions(self.core.context_shard, s, x.device)
            q, k = apply_rotary(q, positions), apply_rotary(k, positions)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = MoELayer(cfg, layer, swiglu=False) if cfg.is_moe_layer(layer) else FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    # > 1 (``train.loss_chunks``, set by the builder): forward stops before the head and ``model_loss`` runs it
    # chunk by chunk, so the whole [tokens, vocab] logits never exist; 1: forward returns logits (generation)
    loss_chunks = 1
    # True (``train.compile``, set by the builder): ``model_loss`` runs the whole-logits loss through
    # ``torch.compile`` too, as torchtitan compiles its loss beside the blocks
    compile_loss = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embeddings: nn.Embedding | None = (
            nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.positions == "learned" else None
        )
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.context_shard = None  # positions of the tokens this rank holds under cp (see token_positions)
        self.documents: Documents | None = None  # under the document mask, per microbatch (``learned_positions``)
        share_balance_pool(self)  # model.moe.balance_loss: pooled
        if not self.layers["0"].attention.wq.weight.is_meta:
            self.init_weights()

    def init_weights(self, seed: int | None = None) -> None:
        """Every parameter from ``init_parameter`` with its own generator (``workers.model.meta_init``).

        ``seed`` defaults to the last ``torch.manual_seed``, so ``GPT(cfg)`` after ``torch.manual_seed(s)``
        equals what every layout's meta-device build draws from job seed ``s``.
        """
        fill(self, torch.initial_seed() if seed is None else seed, self.cfg)

    @property
    def reads_documents(self) -> bool:
        """Whether ``attending`` sets ``documents`` here: only learned positions restart at each document."""
        return self.pos_embeddings is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens -> logits on a whole model; hidden -> hidden on a middle pipeline stage, and on the last one
        when the loss applies the head (``loss_chunks`` > 1, ``model_loss``)."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(x)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(self.learned_positions(x))
        else:
            h = x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None and self.loss_chunks == 1:
            h = self.output(h)
        return h

    def learned_positions(self, x: torch.Tensor) -> torch.Tensor:
        """The learned table's row for each token of ``x`` [batch, seq], as [1 or batch, seq]: its position in the
        window (``token_positions``), or under the document mask (``documents``, set by
        ``workers.model.documents.attending``) its index within its document, as Megatron's
        ``--reset-position-ids``: so a document is seen from its start wherever it sits in the window."""
        positions = token_positions(self.context_shard, x.shape[1], x.device)
        return positions[None] if self.documents is None else self.documents.positions(positions)

    def head_loss(self, hidden: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The head and loss on the last stage's ``hidden`` output, ``loss_chunks`` chunks of tokens at a time
        (``chunked_lm_loss``). A method of the stage, so FSDP2 gathers the sharded head around it as around the
        forward (``register_fsdp_forward_method`` in ``workers.parallel.data_parallel``)."""
        return chunked_lm_loss(hidden, targets, self.output, self.loss_chunks, reduction)


def init_parameter(name: str, shape: tuple, generator: torch.Generator, cfg: ModelConfig) -> torch.Tensor:
    """One full parameter's initial value (the families' ``init_parameter`` hook): an MoE layer's by its own rule
    (``workers.model.moe.moe_parameter``), every other GPT-2 style: normal weights, the residual projections
    scaled by depth so deep stacks start stable; biases (Qwen2's q/k/v) at zero, as ``transformers`` starts
    them; norm weights (the other 1-D ones) at one."""
    routed = moe_parameter(name, shape, generator, cfg)
    if routed is not None:
        return routed
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if len(shape) < 2:
        return torch.ones(shape)
    std = cfg.init_std
    if name.endswith(("wo.weight", "w2.weight")):
        std /= math.sqrt(2 * cfg.n_layers)
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy over the targets that count (ignore_index -100: a loss mask's prompt tokens), in
    float32 whatever the compute dtype: their mean, or with ``reduction="sum"`` their sum (a masked step divides
    it by the global batch's count of counted targets, ``MaskedLM.prepare_step`` in ``workers.step.objectives``)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1), reduction=reduction)


def model_loss(model: nn.Module, out: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """``lm_loss`` of what ``model`` (the part holding the head) returned: its logits, or under ``loss_chunks`` > 1
    its final hidden state, taken through the head chunk by chunk (``chunked_lm_loss``). A model with multi-token
    prediction modules that kept a training forward adds their loss's gradient, not its value
    (``workers.model.mtp``)."""
    loss = _next_token_loss(model, out, targets, reduction)
    if getattr(model, "mtp", None) is not None and model.mtp.kept is not None:
        loss = with_extra_loss(loss, model.mtp_loss(targets, reduction))
    return loss


def _next_token_loss(model: nn.Module, out: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    if model.loss_chunks > 1:
        return model.head_loss(out, targets, reduction)
    if model.compile_loss and not isinstance(out, DTensor):  # DTensor logits (no plan hands them today) stay eager
        return compiled_lm_loss()(out, targets, reduction)
    return lm_loss(out, targets, reduction)


@functools.cache
def compiled_lm_loss():
    """``lm_loss`` through ``torch.compile``, made once per process: inductor fuses the float32 cast, log-softmax
    and gather over the [tokens, vocab] logits into a few passes instead of a float32 copy of them, eager
    log-softmax's output and its backward's (about 5% of a 1B Llama's step at vocabulary 128,256)."""
    return torch.compile(lm_loss)


def chunked_lm_loss(hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module, chunks: int,
                    reduction: str = "mean") -> torch.Tensor:
    """``lm_loss(head(hidden), targets)`` without the whole logits: the sequence cut into ``chunks`` (uneven when
    it does not divide), each chunk's head and float32 cross entropy summed under ``torch.utils.checkpoint``, so
    a chunk's logits are freed after its forward and recomputed one chunk at a time in backward; the sum, or
    divided by the count of counted targets as ``F.cross_entropy``'s mean is.

    Under sequence parallelism the hidden state is a DTensor split along the sequence: it is gathered first (it
    is vocab/d_model times smaller than the logits), so every chunk lines up with its targets and the TP head
    gathers one chunk's logits over the vocabulary at a time."""
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
    pieces = zip(hidden.tensor_split(chunks, dim=1), targets.tensor_split(chunks, dim=1))
    total = sum(checkpoint(_summed_loss, head, h, t, use_reentrant=False) for h, t in pieces if t.numel())
    return total if reduction == "sum" else total / (targets != -100).sum()


def _summed_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One chunk's summed token loss: what ``chunked_lm_loss`` recomputes in backward."""
    return lm_loss(head(hidden), targets, reduction="sum")


register(ModelFamily(
    arch="gpt",
    config=ModelConfig,
    build=GPT,
    lora_targets=("wq", "wk", "wv", "wo", "w1", "w2"),
    recompute_targets={"full": "", "selective": "attention.core"},
    hooks={
        "cut_stage": "workers.parallel.gpt_parallel:cut_stage",
        "tensor_parallel": "workers.parallel.gpt_parallel:apply_tensor_parallel",
        "blocks": "workers.parallel.gpt_parallel:blocks",
        "init_parameter": "workers.model.gpt:init_parameter",
    },
))
