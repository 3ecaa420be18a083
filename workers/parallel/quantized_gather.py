"""Quantized all-gather of ZeRO-1's updated slices (``parallel.param_gather_dtype``, ZeRO++'s qwZ).

Why: after the step, every dp rank needs every other rank's updated rows; in fp32 that all-gather moves as many
bytes as the gradients' reduce-scatter. Sent as int8 codes with one fp32 scale per block of ``BLOCK`` values
(symmetric: ``scale = max|block| / 127``, ``code = round(x / scale)``), it moves 1 + 4/256 bytes per value, about
3.9x fewer; as bf16, half. Rounding to the nearest code errs by at most half a step: ``|deq - x| <= scale / 2 =
max|block| / 254`` per element (bf16: round-to-nearest with 8 significant bits, ``|deq - x| <= 2^-8 |x|``).

Codes and scales travel in one int8 buffer (the scales' bytes appended), so one collective carries both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.contract.param_gather import BLOCK

DTYPES = ("fp32", "bf16", "int8")  # parallel.param_gather_dtype's values


def padded(width: int) -> int:
    """``width`` rounded up to whole blocks (the tail block is zero-padded, which leaves its scale unchanged)."""
    return -(-width // BLOCK) * BLOCK


def quantize(flat: torch.Tensor) -> torch.Tensor:
    """fp32 ``flat`` (a multiple of ``BLOCK`` long) as one int8 buffer: the codes, then the scales' bytes."""
    blocks = flat.view(-1, BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True) / 127
    codes = torch.round(blocks / scale.clamp_min(torch.finfo(torch.float32).tiny)).to(torch.int8)
    return torch.cat([codes.view(-1), scale.view(-1).view(torch.int8)])


def dequantize(packed: torch.Tensor, width: int) -> torch.Tensor:
    """fp32 values of one rank's ``quantize`` output of ``width`` (padded) values."""
    codes, scale = packed[:width].view(-1, BLOCK), packed[width:].view(torch.float32).view(-1, 1)
    return (codes.float() * scale).view(-1)


def gather(mine: torch.Tensor, dtype: str, group) -> torch.Tensor:
    """Every rank's ``mine`` (fp32, same length on each rank) as the values every rank computes with, in one
    all-gather: exact at fp32, else through ``dtype`` on the wire and back to fp32 (rank-major, ``(ranks * n,)``)."""
    ranks = dist.get_world_size(group)
    if dtype == "fp32":
        out = mine.new_empty(ranks * mine.numel())
        dist.all_gather_into_tensor(out, mine, group=group)
        return out
    if dtype == "bf16":
        out = torch.empty(ranks * mine.numel(), dtype=torch.bfloat16, device=mine.device)
        dist.all_gather_into_tensor(out, mine.to(torch.bfloat16), group=group)
        return out.float()
    width = padded(mine.numel())
    packed = quantize(torch.nn.functional.pad(mine, (0, width - mine.numel())))
    out = packed.new_empty(ranks * packed.numel())
    dist.all_gather_into_tensor(out, packed, group=group)
    return torch.cat([dequantize(row, width)[:mine.numel()] for row in out.view(ranks, -1)])
