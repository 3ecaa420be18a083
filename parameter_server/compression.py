"""What crosses the wire between workers and shards: ``parameter_server.compression``.

| kind | push (gradients) | pull (parameters) |
|---|---|---|
| none | each chunk in its own dtype | each chunk in its own dtype |
| bf16 | each chunk cast to bf16 | each chunk cast to bf16 by the shard |
| topk | per chunk, the ``topk_ratio`` largest entries of gradient + error, as a sparse tensor | dense, own dtype |

The worker's side is ``workers.parallel.grad_compression.WireCodec`` (handed to ``PSClient``); this module is
what both sides agree on. The shards keep fp32 parameters and optimizer state either way (``arrived`` turns what
came in back into a dense gradient of the held dtype); only the messages shrink. Top-k keeps error feedback on the
worker (``WireCodec.errors``, per chunk key): what a push left out is added to the next push of that chunk, so
over steps the shards receive the whole gradient sum. The errors live only in the worker's memory: they are not in
snapshots or checkpoints, so a rollback or resume starts them at zero (BSP kill_rank recovery then no longer
matches the uninterrupted run bit for bit under top-k).

Why not PyTorch's compression hooks: they are DDP communication hooks that issue collectives; here the transport
is a message to a shard, so only the top-k selection is shared with the all-reduce path
(``grad_compression.topk_with_feedback``).
"""

from __future__ import annotations

import torch


def nbytes(tensor: torch.Tensor) -> int:
    """Payload bytes of ``tensor`` on the wire (a sparse one: its values plus int32 positions)."""
    if tensor.is_sparse:
        values = tensor._values()
        return values.numel() * (values.element_size() + 4)
    return tensor.numel() * tensor.element_size()


def arrived(key: str, grad: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """The dense gradient of ``held``'s dtype that the message ``grad`` carries. A bf16 or sparse message must
    match ``held``'s shape (the shard's own check then sees the held dtype); any other is returned as it came,
    for that check to refuse."""
    if grad.is_sparse:
        positions = grad._indices()
        if grad.shape != held.shape or grad.dim() != 1 or (positions.numel() and not (
                int(positions.min()) >= 0 and int(positions.max()) < held.numel())):
            raise ValueError(f"push of key {key!r}: sparse shape {tuple(grad.shape)} (positions "
                             f"{positions.min().item() if positions.numel() else None} to "
                             f"{positions.max().item() if positions.numel() else None}), expected a 1-D chunk of "
                             f"shape {tuple(held.shape)}; nothing applied")
        grad = grad.to_dense()
    if grad.dtype == torch.bfloat16 and held.dtype != torch.bfloat16 and held.is_floating_point():
        grad = grad.to(held.dtype)
    return grad


def check_wire_dtype(wire_dtype: str) -> None:
    """``ValueError`` for a pull dtype a shard does not send ("": as held; "bfloat16": cast)."""
    if wire_dtype not in ("", "bfloat16"):
        raise ValueError(f"pull with wire_dtype {wire_dtype!r}: only '' (as held) or 'bfloat16' is sent")


def for_wire(value: torch.Tensor, wire_dtype: str) -> torch.Tensor:
    """A pulled chunk as the reader asked for it (``check_wire_dtype`` first)."""
    return value.to(torch.bfloat16) if wire_dtype == "bfloat16" else value
