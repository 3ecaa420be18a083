"""``parallel.param_gather_dtype`` under ZeRO-2/3: FSDP2's all-gather carries int8 codes or bf16 (ZeRO++'s qwZ).

Why: FSDP2 gathers each unit's parameters before its forward (and, at ZeRO-3, again before its backward); in fp32
those gathers move as many bytes as the whole model per pass. FSDP2 lets a parameter's local shard be a tensor
subclass with ``fsdp_pre_all_gather`` (what goes on the wire) and ``fsdp_post_all_gather`` (what the forward
computes with), the hooks torchao's float8 training gathers fp8 through. Here the shard stays an fp32 tensor (the
optimizer steps it, checkpoints save it), the wire carries int8 codes plus one fp32 scale per ``BLOCK`` values of
each rank's shard (``quantized_gather.quantize``'s codes, so ZeRO-1's bound ``max|block| / 254`` holds) or bf16
(``2^-8 |w|``), and every rank computes with the dequantized weights in the policy's compute dtype. Gradients
are untouched: their reduce-scatter is FSDP2's own (``grad_reduce_dtype`` / the mixed-precision policy).

FSDP2 wants every all-gather input of an unevenly sharded parameter (dim 0 not a multiple of the ranks) in the
padded shard's shape, which leaves no room for the scales: such parameters go as bf16 under int8 (their bound is
bf16's). The subclass wraps the fp32 tensor (``__torch_dispatch__`` runs every op on it) and survives the ops that
make a view, a copy or an alias of the shard (what FSDP2 and DTensor do while sharding); arithmetic returns plain
tensors, so the optimizer's results and the gradients are ordinary fp32. ``plain`` strips it for checkpoints.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_map, tree_map_only

from workers.contract.param_gather import BLOCK
from workers.parallel.quantized_gather import quantize


class _GatherInLowPrecision(torch.Tensor):
    """An fp32 shard whose FSDP2 all-gather moves ``WIRE`` (set by the subclasses below)."""

    WIRE = "bf16"

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=data.dtype,
                                                   device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor):
        self._data = data

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """Run ``func`` on the wrapped fp32 tensors; keep the class on views, copies and aliases of a shard."""
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs or {}))
        return tree_map_only(torch.Tensor, cls, out) if func.overloadpacket in _KEEPS else out

    def plain(self) -> torch.Tensor:
        """The wrapped fp32 shard (same storage): what checkpoints save (``train_state.plain_shards``)."""
        return self._data

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data!r})"

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's shard, zero-padded to the padded shard shape FSDP2 expects, as what goes on the wire."""
        ranks = mesh.size(mesh.ndim - 1)  # HSDP's (replicate, shard) mesh: the shard dimension gathers
        rows = -(-outer_size[0] // ranks)
        shard = self._data.detach()
        padded = shard.new_zeros((rows, *outer_size[1:]))
        padded[:shard.shape[0]].copy_(shard)
        if self.WIRE == "int8" and outer_size[0] % ranks == 0:
            width = -(-padded.numel() // BLOCK) * BLOCK
            packed = quantize(nn.functional.pad(padded.reshape(-1), (0, width - padded.numel())))
            return (packed[:padded.numel()].view(padded.shape), packed[width:].view(torch.float32)), ("int8", ranks)
        return (padded.to(torch.bfloat16),), ("bf16", ranks)

    def fsdp_post_all_gather(self, outputs, wire, param_dtype, *, out=None):
        """The gathered rows (every rank's padded shard, rank-major) as ``param_dtype`` values; into ``out``
        when FSDP2 reuses the unsharded parameter's storage (every gather after the first)."""
        full = _decode(outputs, *wire).to(param_dtype)
        if out is not None:
            # the backward's re-gather refills the tensor autograd saved in the forward: same values' shape, FSDP2's
            # own copy-out keeps the version too (else autograd takes it for an in-place change of a saved tensor)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.view(-1).copy_(full.view(-1)[:out.numel()])
            return None
        return full, (full,)


class Int8Gather(_GatherInLowPrecision):
    """int8 codes + fp32 block scales on the wire (3.94x fewer bytes than fp32)."""

    WIRE = "int8"


class Bf16Gather(_GatherInLowPrecision):
    """bf16 on the wire (half the bytes of fp32)."""

    WIRE = "bf16"


_CLASSES = {"int8": Int8Gather, "bf16": Bf16Gather}
_aten = torch.ops.aten
# ops whose result is (a view, copy or alias of) the shard itself, as FSDP2 and DTensor make while sharding
_KEEPS = {_aten.detach, _aten.view, _aten._unsafe_view, _aten.as_strided, _aten.slice, _aten.narrow, _aten.split,
          _aten.split_with_sizes, _aten.chunk, _aten.new_zeros, _aten.new_empty, _aten._to_copy, _aten.copy_,
          _aten.empty_like,
          _aten.alias, _aten.t, _aten.unsqueeze, _aten.squeeze, _aten.reshape}


def _unwrap(t):
    """The fp32 tensor a gather subclass wraps (anything else unchanged)."""
    return t._data if isinstance(t, _GatherInLowPrecision) else t


def _decode(outputs: tuple[torch.Tensor, ...], wire: str, ranks: int) -> torch.Tensor:
    """fp32 values of the gathered wire tensors: bf16 widened; int8 codes times their sender's block scales
    (each rank's shard was quantized on its own, so blocks restart at every rank's rows)."""
    if wire == "bf16":
        return outputs[0].float()
    codes, scales = outputs
    shard = codes.numel() // ranks
    blocks = scales.numel() // ranks
    flat = nn.functional.pad(codes.reshape(ranks, shard).float(), (0, blocks * BLOCK - shard))
    values = flat.view(ranks, blocks, BLOCK) * scales.view(ranks, blocks, 1)
    # contiguous: FSDP2 reads the result through as_strided with the parameter's contiguous strides
    return values.reshape(ranks, -1)[:, :shard].contiguous().view(codes.shape)


def wrap_for_gather(module: nn.Module, dtype: str) -> None:
    """Make every plain fp32 parameter of ``module`` (before ``fully_shard``) gather as ``dtype`` ("fp32":
    nothing). Other tensor subclasses (QLoRA's NF4 base weights, DTensors) and 16-bit parameters stay as they are."""
    if dtype == "fp32":
        return
    cls = _CLASSES[dtype]
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            if type(p) is nn.Parameter and p.dtype == torch.float32:
                sub._parameters[name] = nn.Parameter(cls(p.detach()), requires_grad=p.requires_grad)
