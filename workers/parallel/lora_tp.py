"""Tensor-parallel placement of LoRA adapters, derived from their base layer's DTensor style.

For a column-parallel base (W sharded on its output rows) the adapter's
``B`` is column-parallel too and ``A`` (rank x in, small) is replicated: each
rank computes the full rank-r projection and its own slice of ``B A x``, which
lines up with its slice of ``W x`` with no extra forward communication; the
backward all-reduce of ``A``'s output gradient comes from ``B``'s input
boundary, just as for the base layer's input.

For a row-parallel base (W sharded on its input columns) ``A`` is row-parallel
(each rank holds the columns matching its input shard; the rank-r partial sums
are all-reduced — r values per token, not d_model) and ``B`` is replicated,
its output moved to the base's output layout (a local slice under sequence
parallelism).

An NF4 (QLoRA) base keeps its style through ``workers.parallel.nf4_tp``.

Replicated weights are DTensors (``Replicate()``), so their gradients are
reduced where partial and the global gradient norm counts them once.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from workers.model.lora import LoRALinear
from workers.model.nf4 import NF4Linear
from workers.parallel.nf4_tp import NF4Parallel


class ReplicateParallel(ColwiseParallel):
    """A Linear with its weight replicated over the TP mesh: input made ``Replicate``, output to ``output_layouts``.

    Reuses ColwiseParallel's input/output conversion; only the partition differs
    (``distribute_module`` replicates every parameter when given no partition function).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, None,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


def adapter_styles(style: ParallelStyle) -> tuple[ParallelStyle, ParallelStyle]:
    """Styles for ``(lora_a, lora_b)`` beside a base Linear placed with ``style``."""
    inp, out, local = style.input_layouts[0], style.output_layouts[0], style.use_local_output
    if isinstance(style, ColwiseParallel):
        return (ReplicateParallel(input_layouts=inp, output_layouts=Replicate()),
                ColwiseParallel(input_layouts=Replicate(), output_layouts=out, use_local_output=local))
    if isinstance(style, RowwiseParallel):
        return (RowwiseParallel(input_layouts=inp, output_layouts=Replicate()),
                ReplicateParallel(input_layouts=Replicate(), output_layouts=out, use_local_output=local))
    raise NotImplementedError(f"no LoRA placement for a base layer under {type(style).__name__}")


def adapt_plan(module: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` with every entry that names a ``LoRALinear`` split into its base and adapter entries."""
    out = {}
    for name, style in plan.items():
        target = module.get_submodule(name)
        if not isinstance(target, LoRALinear):
            out[name] = style
            continue
        out[f"{name}.base"] = NF4Parallel(style) if isinstance(target.base, NF4Linear) else style
        out[f"{name}.lora_a"], out[f"{name}.lora_b"] = adapter_styles(style)
    return out
