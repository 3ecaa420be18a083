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
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.model.documents import Documents, documents_of

# the arguments every attention operator takes after q, k, v (see ``Forward`` for their meaning)
_ARGS = "Tensor? ids, int? window, bool causal, str group"
_FORWARD = f"(Tensor q, Tensor k, Tensor v, {_ARGS}) -> (Tensor, Tensor, Tensor)"
_BACKWARD = f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor saved, {_ARGS}) " \
            "-> (Tensor, Tensor, Tensor)"

# forward(q, k, v, documents, window, causal, group) -> (out, lse, saved): group is a process group's name ("" on
# one process), documents a ``Documents`` or None
Forward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# backward(dout, q, k, v, out, lse, saved, documents, window, causal, group) -> (dq, dk, dv)
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


# qualified operator name -> its Python implementation: a dispatch mode that must see the collectives inside an
# operator (``workers.diagnostics.comm_bytes.CommBytes``) runs it through this, with itself active
IMPLEMENTATIONS: dict[str, Callable] = {}


def custom_op(name: str, fn: Callable, schema: str):
    """``torch.library.custom_op`` of ``fn`` as ``raymesh::<name>``, its implementation kept in
    ``IMPLEMENTATIONS``."""
    IMPLEMENTATIONS[f"raymesh::{name}"] = fn
    return torch.library.custom_op(f"raymesh::{name}", fn, mutates_args=(), schema=schema)


def register_attention(name: str, forward: Forward, backward: Backward,
                       saved_shape: Callable[[torch.Tensor, str], tuple] | None = None):
    """Register ``raymesh::<name>`` (forward) and ``raymesh::<name>_backward`` with their fake implementations and
    autograd; return a function ``(q, k, v, documents, window, causal, group) -> out``. ``saved_shape(k, group)``
    is the shape of the forward's saved tensor (empty when not given)."""

    def forward_impl(q, k, v, ids, window, causal, group):
        return forward(q, k, v, documents_of(ids), window, causal, group)

    def backward_impl(dout, q, k, v, out, lse, saved, ids, window, causal, group):
        return backward(dout.contiguous(), q, k, v, out, lse, saved, documents_of(ids), window, causal, group)

    op = custom_op(name, forward_impl, _FORWARD)
    op_backward = custom_op(f"{name}_backward", backward_impl, _BACKWARD)

    @op.register_fake
    def _(q, k, v, ids, window, causal, group):
        shape = saved_shape(k, group) if saved_shape is not None else (0,)
        return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32), k.new_empty(shape)

    @op_backward.register_fake
    def _(dout, q, k, v, out, lse, saved, ids, window, causal, group):
        return torch.empty_like(q), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup_context(ctx, inputs, output):
        """Save what SDPA's backward saves (q, k, v, out, lse) and the gathered K/V where there are any; the ids
        are one tensor every layer shares, kept as they are (not through saved-tensor hooks, as the dense mask
        was not: ``is_shared_mask``)."""
        q, k, v, ctx.ids, *ctx.rest = inputs
        out, lse, saved = output
        ctx.gathered = saved.numel() > 0
        ctx.save_for_backward(q, k, v, out, lse, *([saved] if ctx.gathered else []))

    def differentiate(ctx, dout, _dlse, _dsaved):
        q, k, v, out, lse, *saved = ctx.saved_tensors
        saved = saved[0] if ctx.gathered else q.new_empty(0)
        return (*op_backward(dout, q, k, v, out, lse, saved, ctx.ids, *ctx.rest), None, None, None, None)

    op.register_autograd(differentiate, setup_context=setup_context)

    def attend(q, k, v, documents: Documents | None, window: int | None, causal: bool, group: str) -> torch.Tensor:
        return op(q, k, v, None if documents is None else documents.ids, window, causal, group)[0]
    return attend
