"""QLoRA's 4-bit NormalFloat (NF4) storage for frozen base weights, in plain PyTorch.

Our own implementation (bitsandbytes' kernels are CUDA-only), following the
QLoRA paper (Dettmers et al., 2023):

* the code book holds 16 values at quantiles of N(0, 1), rescaled to [-1, 1],
  with an exact zero — pre-trained weights are roughly normal, so equal-mass
  bins waste no codes on the tails;
* weights are quantized in blocks of 64: each block is divided by its absmax
  and every value becomes the index of its nearest code (4 bits, two per byte);
* double quantization: the fp32 absmax of every block (0.5 bit/param on its
  own) is stored as 8 bits — minus their mean, in groups of 256 with one fp32
  step per group — which brings the scales to 8/64 + 32/(64*256) = 0.127
  bit/param;
* the forward pass dequantizes block by block (code value times its block's
  scale) and backward dequantizes again instead of saving the full-precision
  weight for later, which is what keeps activation memory at 4-bit weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 64  # weights per absmax scale
SCALE_BLOCK = 256  # absmax scales per 8-bit step (double quantization)
# QLoRA's quantile offset: the outermost bins end at the 1 - 0.9677 tail, not at infinity
_OFFSET = 0.9677083


def _code_book() -> torch.Tensor:
    """The 16 NF4 values: 8 positive and 7 negative normal quantiles, an exact 0, scaled to [-1, 1]."""
    positive = torch.special.ndtri(torch.linspace(_OFFSET, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(_OFFSET, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([positive, negative, torch.zeros(1, dtype=torch.float64)]).sort().values
    return (values / values.abs().max()).float()


CODE_BOOK = _code_book()


def shard_problem(shape: tuple[int, int], dim: int, count: int) -> str | None:
    """Why a ``shape`` weight's NF4 blocks cannot be split ``count`` ways along ``dim`` (None: they can).

    A shard must be whole 64-weight blocks of the weight quantized whole, so that every rank
    dequantizes exactly the values a single process does: rows (dim 0) split into contiguous
    runs of blocks when a shard's size is a multiple of 64; columns (dim 1) only when each row's
    share of columns is."""
    rows, cols = shape
    if dim == 0 and (rows % count or (rows // count * cols) % BLOCK):
        return f"{rows // count}x{cols} row shards are not whole blocks of {BLOCK} weights"
    if dim == 1 and cols % (BLOCK * count):
        return f"{rows}x{cols // count} column shards do not start rows at whole blocks of {BLOCK} weights"
    return None


@dataclass
class NF4Tensor:
    """A quantized weight: packed 4-bit codes plus double-quantized per-block scales.

    A tensor-parallel shard (``shard``) holds a subset of the whole weight's blocks: its block ``j``
    is the whole weight's block ``first_block + (j // row_blocks) * row_stride + j % row_blocks``
    (``row_blocks`` None: a contiguous run), and ``scale_step`` stays the whole weight's.
    """

    codes: torch.Tensor  # uint8 [numel / 2]: two codes per byte, high nibble first
    scale_codes: torch.Tensor  # int8 [numel / 64]: absmax - offset, in steps of scale_step
    scale_step: torch.Tensor  # fp32 [ceil(blocks / 256)] of the whole weight
    scale_offset: torch.Tensor  # fp32 scalar: mean absmax
    shape: torch.Size
    first_block: int = 0
    row_blocks: int | None = None
    row_stride: int = 0

    def nbytes(self) -> int:
        parts = (self.codes, self.scale_codes, self.scale_step, self.scale_offset)
        return sum(t.numel() * t.element_size() for t in parts)

    def absmax(self) -> torch.Tensor:
        """The per-block scales back from their 8-bit codes."""
        j = torch.arange(self.scale_codes.numel(), device=self.scale_codes.device)
        if self.row_blocks is not None:
            j = (j // self.row_blocks) * self.row_stride + j % self.row_blocks
        return self.scale_codes.float() * self.scale_step[(j + self.first_block) // SCALE_BLOCK] + self.scale_offset

    def dequantize(self) -> torch.Tensor:
        codes = torch.stack((self.codes >> 4, self.codes & 0xF), dim=-1).flatten().long()
        blocks = CODE_BOOK.to(codes.device)[codes].view(-1, BLOCK) * self.absmax()[:, None]
        return blocks.view(self.shape)

    def shard(self, dim: int, index: int, count: int) -> NF4Tensor:
        """Shard ``index`` of ``count`` of this whole 2-D weight along ``dim``: its blocks, copied out."""
        problem = shard_problem(tuple(self.shape), dim, count)
        if problem:
            raise ValueError(problem)
        rows, cols = self.shape
        if dim == 0:
            n = rows // count * cols // BLOCK
            first = index * n
            return NF4Tensor(self.codes[first * BLOCK // 2:(first + n) * BLOCK // 2].clone(),
                             self.scale_codes[first:first + n].clone(), self.scale_step, self.scale_offset,
                             torch.Size((rows // count, cols)), first)
        width, grid = cols // count, cols // BLOCK
        per_row = width // BLOCK
        codes = self.codes.view(rows, cols // 2)[:, index * width // 2:(index + 1) * width // 2]
        scales = self.scale_codes.view(rows, grid)[:, index * per_row:(index + 1) * per_row]
        return NF4Tensor(codes.contiguous().flatten(), scales.contiguous().flatten(), self.scale_step,
                         self.scale_offset, torch.Size((rows, width)), index * per_row, per_row, grid)


def quantize(weight: torch.Tensor) -> NF4Tensor:
    """NF4-quantize ``weight`` (any shape whose size is a multiple of 64)."""
    if weight.numel() % BLOCK:
        raise ValueError(f"NF4 needs a multiple of {BLOCK} elements, got shape {tuple(weight.shape)}")
    blocks = weight.detach().float().reshape(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    book = CODE_BOOK.to(weight.device)
    codes = (blocks / absmax[:, None]).unsqueeze(-1).sub(book).abs().argmin(dim=-1).to(torch.uint8).flatten()
    packed = (codes[0::2] << 4) | codes[1::2]
    offset = absmax.mean()
    centred = absmax - offset
    pad = (-centred.numel()) % SCALE_BLOCK
    groups = F.pad(centred, (0, pad)).view(-1, SCALE_BLOCK)
    step = (groups.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    # cloned: a slice would keep the whole padded group tensor alive (up to 255 bytes a weight matrix)
    scale_codes = (groups / step[:, None]).round().clamp(-127, 127).to(torch.int8).flatten()[: centred.numel()].clone()
    return NF4Tensor(packed, scale_codes, step, offset, weight.shape)


class _FrozenNF4Linear(torch.autograd.Function):
    """``x @ W.T`` with W rebuilt from NF4 in forward and again in backward; W gets no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: NF4Linear) -> torch.Tensor:
        ctx.module = module
        weight = module.weight_nf4().dequantize()
        return F.linear(x, weight.to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = ctx.module.weight_nf4().dequantize()
        return grad @ weight.to(grad.dtype), None


class NF4Linear(nn.Module):
    """A frozen bias-free ``nn.Linear`` whose weight lives in NF4.

    The quantized state is held as non-persistent buffers: it moves with the
    module between devices but stays out of checkpoints, because it is rebuilt
    exactly (quantization is deterministic) from the seed or the base
    checkpoint every time the model is built.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("NF4Linear supports bias-free Linear layers (the GPT has no biases)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.tp_shard: tuple[int, int, int] | None = None  # (dim, index, count) once shard_ cut it
        self._use(quantize(linear.weight))  # on meta: shapes only, values come from requantize

    def _use(self, q: NF4Tensor) -> None:
        for name in ("codes", "scale_codes", "scale_step", "scale_offset"):
            self.register_buffer(name, getattr(q, name), persistent=False)
        self.layout = (q.shape, q.first_block, q.row_blocks, q.row_stride)

    def weight_nf4(self) -> NF4Tensor:
        return NF4Tensor(self.codes, self.scale_codes, self.scale_step, self.scale_offset, *self.layout)

    def shard_(self, dim: int, index: int, count: int) -> None:
        """Keep only tensor-parallel shard ``index`` of ``count`` along ``dim`` (``workers.parallel.nf4_tp``)."""
        self._use(self.weight_nf4().shard(dim, index, count))
        self.tp_shard = (dim, index, count)

    def requantize(self, weight: torch.Tensor) -> None:
        """Quantize the whole ``weight`` again and keep this layer's shard of it (meta-device init: the
        quantized state is drawn per layer, never from a whole model)."""
        q = quantize(weight)
        if self.tp_shard is not None:
            q = q.shard(*self.tp_shard)
        device = self.codes.device
        self._use(NF4Tensor(*(t.to(device) for t in (q.codes, q.scale_codes, q.scale_step, q.scale_offset)),
                            q.shape, q.first_block, q.row_blocks, q.row_stride))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FrozenNF4Linear.apply(x, self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4"
