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


@dataclass
class NF4Tensor:
    """A quantized weight: packed 4-bit codes plus double-quantized per-block scales."""

    codes: torch.Tensor  # uint8 [numel / 2]: two codes per byte, high nibble first
    scale_codes: torch.Tensor  # int8 [numel / 64]: absmax - offset, in steps of scale_step
    scale_step: torch.Tensor  # fp32 [ceil(blocks / 256)]
    scale_offset: torch.Tensor  # fp32 scalar: mean absmax
    shape: torch.Size

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale_codes, self.scale_step, self.scale_offset))

    def absmax(self) -> torch.Tensor:
        """The per-block scales back from their 8-bit codes."""
        steps = self.scale_step.repeat_interleave(SCALE_BLOCK)[: self.scale_codes.numel()]
        return self.scale_codes.float() * steps + self.scale_offset

    def dequantize(self) -> torch.Tensor:
        codes = torch.stack((self.codes >> 4, self.codes & 0xF), dim=-1).flatten().long()
        blocks = CODE_BOOK.to(codes.device)[codes].view(-1, BLOCK) * self.absmax()[:, None]
        return blocks.view(self.shape)


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
        q = quantize(linear.weight)
        for name in ("codes", "scale_codes", "scale_step", "scale_offset"):
            self.register_buffer(name, getattr(q, name), persistent=False)

    def weight_nf4(self) -> NF4Tensor:
        return NF4Tensor(self.codes, self.scale_codes, self.scale_step, self.scale_offset,
                         torch.Size((self.out_features, self.in_features)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FrozenNF4Linear.apply(x, self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4"
