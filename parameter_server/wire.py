"""Tensors on the gRPC wire: raw bytes with dtype and shape (any torch dtype, bf16 included); a sparse 1-D
tensor (top-k compression) as its values plus int32 positions."""

from __future__ import annotations

import torch

from parameter_server.proto import ps_pb2


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def to_msg(key: str, tensor: torch.Tensor) -> ps_pb2.Tensor:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.is_sparse:
        t = tensor.coalesce()
        return ps_pb2.Tensor(key=key, dtype=dtype, shape=list(t.shape), data=_raw(t.values()),
                             indices=_raw(t.indices()[0].to(torch.int32)))
    return ps_pb2.Tensor(key=key, dtype=dtype, shape=list(tensor.shape), data=_raw(tensor))


def _sparse(msg: ps_pb2.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A sparse message's 1-D tensor; ``ValueError`` when it is not 1-D or its positions and values disagree."""
    if len(msg.shape) != 1 or len(msg.indices) % 4:
        raise ValueError(f"tensor {msg.key!r}: a sparse tensor is 1-D with int32 positions, got shape "
                         f"{list(msg.shape)} and {len(msg.indices)} position bytes")
    positions = torch.frombuffer(bytearray(msg.indices), dtype=torch.int32).long()
    if len(msg.data) != positions.numel() * dtype.itemsize:
        raise ValueError(f"tensor {msg.key!r}: {len(msg.data)} value bytes for {positions.numel()} positions "
                         f"of {dtype}")
    if positions.numel() and not (int(positions.min()) >= 0 and int(positions.max()) < numel):
        raise ValueError(f"tensor {msg.key!r}: a position outside shape {list(msg.shape)}")
    values = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(dtype) if msg.data else \
        torch.empty(0, dtype=dtype)
    return torch.sparse_coo_tensor(positions.unsqueeze(0), values, (numel,), check_invariants=True)


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
    if msg.indices:
        return _sparse(msg, dtype, numel)
    if len(msg.data) != numel * dtype.itemsize:
        raise ValueError(f"tensor {msg.key!r}: {len(msg.data)} bytes do not hold shape {list(msg.shape)} of {dtype}")
    raw = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8) if msg.data else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(tuple(msg.shape))


def to_dict(msgs) -> dict[str, torch.Tensor]:
    return {m.key: from_msg(m) for m in msgs}
