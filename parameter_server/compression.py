"""What crosses the wire between workers and shards: ``parameter_server.compression``.

| kind | push (gradients) | pull (parameters) |
|---|---|---|
| none | each chunk in its own dtype | each chunk in its own dtype |
| bf16 | each chunk cast to bf16 | each chunk cast to bf16 by the shard |
| topk | per chunk, the ``topk_ratio`` largest entries of gradient + error, as a sparse tensor | dense, own dtype |

The shards keep fp32 parameters and optimizer state either way (``arrived`` turns what came in back into a dense
gradient of the held dtype); only the messages shrink. Top-k keeps error feedback on the worker
(``WireCodec.errors``, per chunk key): what a push left out is added to the next push of that chunk, so over steps
the shards receive the whole gradient sum. The errors live only in the worker's memory: they are not in
snapshots or checkpoints, so a rollback or resume starts them at zero (BSP kill_rank recovery then no longer
matches the uninterrupted run bit for bit under top-k).

Why not PyTorch's compression hooks: they are DDP communication hooks that issue collectives; here the transport
is a message to a shard, so only the top-k selection is shared (``grad_compression.topk_with_feedback``).
"""

from __future__ import annotations

import torch

from workers.parallel.grad_compression import topk_with_feedback

KINDS = ("none", "bf16", "topk")
WIRE_DTYPE = {"none": "", "bf16": "bfloat16", "topk": ""}  # what a pull asks the shard to send


def nbytes(tensor: torch.Tensor) -> int:
    """Payload bytes of ``tensor`` on the wire (a sparse one: its values plus int32 positions)."""
    if tensor.is_sparse:
        values = tensor._values()
        return values.numel() * (values.element_size() + 4)
    return tensor.numel() * tensor.element_size()


class WireCodec:
    """A worker's side: encodes each push, says which dtype pulls come in, keeps top-k's error feedback."""

    def __init__(self, kind: str = "none", topk_ratio: float = 0.01):
        if kind not in KINDS:
            raise ValueError(f"parameter_server.compression {kind!r} is not one of {', '.join(KINDS)}")
        self.kind, self.ratio = kind, topk_ratio
        self.errors: dict[str, torch.Tensor] = {}
        self.pull_dtype = WIRE_DTYPE[kind]

    def encode(self, chunks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The messages for one push of ``chunks`` (flat gradient chunks by key)."""
        if self.kind == "bf16":
            return {k: c.to(torch.bfloat16) for k, c in chunks.items()}
        if self.kind == "topk":
            return {k: self._topk(k, c) for k, c in chunks.items()}
        return chunks

    def _topk(self, key: str, chunk: torch.Tensor) -> torch.Tensor:
        flat = chunk.detach().reshape(-1).clone()
        indices, values, self.errors[key] = topk_with_feedback(flat, self.ratio, self.errors.get(key))
        return torch.sparse_coo_tensor(indices.unsqueeze(0), values, flat.shape, check_invariants=False).coalesce()


def arrived(key: str, grad: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """The dense gradient of ``held``'s dtype that the message ``grad`` carries. A bf16 or sparse message must
    match ``held``'s shape (the shard's own check then sees the held dtype); any other is returned as it came,
    for that check to refuse."""
    if grad.is_sparse:
        if grad.shape != held.shape:
            raise ValueError(f"push of key {key!r}: sparse shape {tuple(grad.shape)}, expected {tuple(held.shape)}; "
                             "nothing applied")
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
