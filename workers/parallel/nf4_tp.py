"""Tensor parallelism for QLoRA's NF4 base layers: shard the quantized blocks, keep PyTorch's layouts around them.

PyTorch's ``ColwiseParallel``/``RowwiseParallel`` shard a Linear's parameters;
an ``NF4Linear`` has none (its weight is packed codes and scales in buffers),
and ``distribute_module`` would replicate those buffers from rank 0. So this
style cuts the buffers itself (``NF4Linear.shard_``: the weight is quantized
whole, as in the single-process model, and each rank keeps the blocks of its
rows or columns, so every rank dequantizes exactly the reference's values) and
reuses the wrapped style's own input and output conversions as hooks around the
plain local matmul:

- column-parallel: the input arrives ``Replicate``, the local output is the
  ``Shard(-1)`` slice of the full output, and the input's gradient is
  ``Partial`` (each rank's rows contribute a part), reduced like a Linear's;
- row-parallel: the input arrives ``Shard(-1)``, the local output is a
  ``Partial`` sum, reduced (reduce-scattered under sequence parallelism) by
  ``RowwiseParallel``'s output conversion.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from workers.model.nf4 import NF4Linear


class NF4Parallel(ParallelStyle):
    """``style`` (Colwise or Rowwise) applied to an ``NF4Linear``."""

    def __init__(self, style: ParallelStyle):
        self.style = style
        self.colwise = isinstance(style, ColwiseParallel)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, NF4Linear):
            raise NotImplementedError(f"NF4Parallel places NF4Linear layers, not {type(module).__name__}")
        s, colwise = self.style, self.colwise
        module.shard_(0 if colwise else 1, device_mesh.get_local_rank(), device_mesh.size())
        wanted = (Replicate(),) if colwise else (Shard(-1),)  # what the style's Linear _apply would ask for
        input_grad = [Partial()] if colwise else None
        output = [Shard(-1)] if colwise else [Partial()]

        def local_input(mod, inputs):
            x = s._prepare_input_fn(s.input_layouts, wanted, mod, inputs, device_mesh)
            return (x.to_local(grad_placements=input_grad),)

        def placed_output(mod, inputs, y):
            y = DTensor.from_local(y, device_mesh, output, run_check=False)
            return s._prepare_output_fn(s.output_layouts, s.use_local_output, mod, y, device_mesh)

        module.register_forward_pre_hook(local_input)
        module.register_forward_hook(placed_output)
        return module
