"""Blockwise and context-parallel attention as ``torch.library`` custom operators, so ``train.compile`` traces the
blocks around them.

Why operators: the kernels fold tiles into an online softmax in a Python loop whose tiles depend on the document ids
(a device sync per row tile), and the context-parallel ones send and receive K/V inside that loop: Dynamo cannot
trace either whole (``fullgraph``). A custom operator is one opaque node to Dynamo and AOTAutograd: its forward and
backward run the same eager code as before (collectives included), its fake implementation gives the shapes, and
``register_autograd`` ties the backward operator to it. Used in eager runs too, so one path is tested everywhere.

What crosses the operator boundary is what its schema can carry: tensors, ints, bools and strings. A process group
travels by its name (resolved inside), the documents by their ids tensor. The tile masks that every layer of a
microbatch shares stay shared: the ids are matched to the live ``Documents`` holding that tensor (``documents_of``),
so its cache serves the operator; a tensor no ``Documents`` holds gets a fresh one (the same masks, rebuilt).

Each operator returns (out, lse, saved): the output, its log-sum-exp (what the backward recomputes blocks from) and
whatever else the backward keeps (the all-gathered K/V; empty elsewhere).

Attention sinks (gpt-oss) are one optional argument of every operator, ``sinks`` [Hq]: one more logit per head in
every row's softmax whose value vector is zero. A kernel only has to start its running softmax from them (the
merged lse then holds them, and the keys' gradients from that lse are exact as they stand); their own gradient
needs nothing but the row's output and lse, so it is formed here once for every kernel (``sink_gradient``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.model.documents import Documents, documents_of

# the arguments every attention operator takes after q, k, v (see ``Forward`` for their meaning)
_ARGS = "Tensor? sinks, Tensor? ids, int? window, bool causal, str group"
_FORWARD = f"(Tensor q, Tensor k, Tensor v, {_ARGS}) -> (Tensor, Tensor, Tensor)"
_BACKWARD = f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor saved, {_ARGS}) " \
            "-> (Tensor, Tensor, Tensor, Tensor)"

# forward(q, k, v, sinks, documents, window, causal, group) -> (out, lse, saved): sinks [Hq] or None (the running
# softmax starts from them), group a process group's name ("" on one process), documents a ``Documents`` or None
Forward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# backward(dout, q, k, v, out, lse, saved, documents, window, causal, group) -> (dq, dk, dv): the out and lse hold
# the sinks, so the kernels' backwards need not see them
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


# qualified operator name -> its Python implementation: a dispatch mode that must see the collectives inside an
# operator (``workers.diagnostics.comm_bytes.CommBytes``) runs it through this, with itself active
IMPLEMENTATIONS: dict[str, Callable] = {}


def custom_op(name: str, fn: Callable, schema: str):
    """``torch.library.custom_op`` of ``fn`` as ``raymesh::<name>``, its implementation kept in
    ``IMPLEMENTATIONS``."""
    IMPLEMENTATIONS[f"raymesh::{name}"] = fn
    return torch.library.custom_op(f"raymesh::{name}", fn, mutates_args=(), schema=schema)


def sink_gradient(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks [Hq] of attention with sinks (gpt-oss), from its merged output and lse ``[B, Hq, S]``.

    A sink is one more logit per head in every row's softmax whose value vector is zero: it takes probability
    p = exp(sink - lse) and adds nothing to the output. The softmax backward gives each logit p * (dout . v -
    delta) with delta = dout . out; for the sink v is 0, so its gradient is -p * delta, summed over the rows this
    rank holds (a context-parallel rank's share; the ranks' shares sum with the other gradients)."""
    delta = (dout.float() * out.float()).sum(-1)
    p = torch.exp(sinks.float().view(1, -1, 1) - lse)
    return -(p * delta).sum((0, 2)).to(sinks.dtype)


def register_attention(name: str, forward: Forward, backward: Backward,
                       saved_shape: Callable[[torch.Tensor, str], tuple] | None = None):
    """Register ``raymesh::<name>`` (forward) and ``raymesh::<name>_backward`` with their fake implementations and
    autograd; return a function ``(q, k, v, documents, window, causal, group, sinks=None) -> out``.
    ``saved_shape(k, group)`` is the shape of the forward's saved tensor (empty when not given)."""

    def forward_impl(q, k, v, sinks, ids, window, causal, group):
        return forward(q, k, v, sinks, documents_of(ids), window, causal, group)

    def backward_impl(dout, q, k, v, out, lse, saved, sinks, ids, window, causal, group):
        dout = dout.contiguous()
        dq, dk, dv = backward(dout, q, k, v, out, lse, saved, documents_of(ids), window, causal, group)
        return dq, dk, dv, q.new_empty(0) if sinks is None else sink_gradient(dout, out, lse, sinks)

    op = custom_op(name, forward_impl, _FORWARD)
    op_backward = custom_op(f"{name}_backward", backward_impl, _BACKWARD)

    @op.register_fake
    def _(q, k, v, sinks, ids, window, causal, group):
        shape = saved_shape(k, group) if saved_shape is not None else (0,)
        return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32), k.new_empty(shape)

    @op_backward.register_fake
    def _(dout, q, k, v, out, lse, saved, sinks, ids, window, causal, group):
        return (torch.empty_like(q), k.new_empty(k.shape), v.new_empty(v.shape),
                q.new_empty(0) if sinks is None else torch.empty_like(sinks))

    def setup_context(ctx, inputs, output):
        """Save what SDPA's backward saves (q, k, v, out, lse), the sinks and the gathered K/V where there are any;
        the ids are one tensor every layer shares, kept as they are (not through saved-tensor hooks, as the dense
        mask was not: ``is_shared_mask``)."""
        q, k, v, sinks, ctx.ids, *ctx.rest = inputs
        out, lse, saved = output
        ctx.gathered, ctx.sunk = saved.numel() > 0, sinks is not None
        ctx.save_for_backward(q, k, v, out, lse, *([saved] if ctx.gathered else []), *([sinks] if ctx.sunk else []))

    def differentiate(ctx, dout, _dlse, _dsaved):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        saved = rest.pop(0) if ctx.gathered else q.new_empty(0)
        sinks = rest.pop(0) if ctx.sunk else None
        dq, dk, dv, dsinks = op_backward(dout, q, k, v, out, lse, saved, sinks, ctx.ids, *ctx.rest)
        return dq, dk, dv, dsinks if ctx.sunk else None, None, None, None, None

    op.register_autograd(differentiate, setup_context=setup_context)

    def attend(q, k, v, documents: Documents | None, window: int | None, causal: bool, group: str,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        return op(q, k, v, sinks, None if documents is None else documents.ids, window, causal, group)[0]
    return attend
