"""Tensors on the gRPC wire: raw bytes with dtype and shape (any torch dtype, bf16 included)."""

from __future__ import annotations

import torch

from parameter_server.proto import ps_pb2


def to_msg(key: str, tensor: torch.Tensor) -> ps_pb2.Tensor:
    t = tensor.detach().contiguous().cpu()
    return ps_pb2.Tensor(key=key, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                         data=t.reshape(-1).view(torch.uint8).numpy().tobytes())


def from_msg(msg: ps_pb2.Tensor) -> torch.Tensor:
    """The tensor ``msg`` carries; ``ValueError`` when its dtype is no torch dtype or its bytes do not fill its
    shape (a message from outside is checked before anything reads it)."""
    dtype = getattr(torch, msg.dtype, None) if msg.dtype.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensor {msg.key!r}: dtype {msg.dtype!r} is not a torch dtype")
    numel = 1
    for size in msg.shape:
        if size < 0:
            raise ValueError(f"tensor {msg.key!r}: negative size in shape {list(msg.shape)}")
        numel *= size
    if len(msg.data) != numel * dtype.itemsize:
        raise ValueError(f"tensor {msg.key!r}: {len(msg.data)} bytes do not hold shape {list(msg.shape)} of {dtype}")
    raw = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8) if msg.data else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(tuple(msg.shape))


def to_dict(msgs) -> dict[str, torch.Tensor]:
    return {m.key: from_msg(m) for m in msgs}
