"""DeepSeek-V3's tensor-parallel plan: multi-head latent attention split by heads, the rest Llama's.

MLA (``workers.model.deepseek.LatentAttention``) under tp, Megatron-Core's ``multi_latent_attention`` split:

- the down projections ``wq_a`` (d -> q_lora_rank) and ``wkv_a`` (d -> kv_lora_rank + the decoupled rotary key)
  and the latent norms ``q_norm``/``kv_norm`` stay replicated, plain tensors: they are small (rank x d), and every
  head needs the whole latent and the one rotary key all heads share. The attention's input is the block's
  activation gathered to Replicate and handed in as a plain tensor. In the backward the column-parallel up
  projections' input styles sum the latents' gradient over tp; the rotary key, used by each rank's own heads only,
  gets its gradient summed over tp by a hook on ``wkv_a``'s output (``sum_rope_key_grad``). So these weights, and
  the block's input, get the same whole gradient on every tp rank.
- the up projections ``wq_b`` (or ``wq`` without a low-rank query) and ``wkv_b`` are column-parallel: their rows
  are laid out head after head, so rank r gets heads r*n/tp .. (r+1)*n/tp of the queries, keys and values, and the
  attention core runs on its own heads (``LatentAttention.forward`` reads the head count from the shapes).
- the output projection ``wo`` is row-parallel back to the activation layout (Shard(1) under sequence parallelism,
  whose norms are ``SequenceParallel``): one all-reduce (or reduce-scatter) per attention, as Llama's.

Feed-forwards: the first dense blocks' SwiGLU is Llama's (w1/w3 column-, w2 row-parallel). An MoE block's layer is
replicated over tp (``gpt_parallel.moe_style``; the routed experts are split over tp only by
``parallel.expert_tp``, inside the expert-parallel dispatch), but its shared experts, dense and run by every token,
are split by their hidden units like a dense SwiGLU (``SharedHidden``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput

from workers.model.deepseek import DeepseekV3
from workers.model.moe import HIDDEN_DIM
from workers.parallel import llama_parallel
from workers.parallel.gpt_parallel import is_moe
from workers.parallel.tensor_parallel import activation_layout, apply_plan


class _SumTail(torch.autograd.Function):
    """Identity forward; the backward sums the last ``width`` channels of the gradient over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, width: int, group) -> torch.Tensor:
        ctx.width, ctx.group = width, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tail = grad[..., -ctx.width:].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        return torch.cat((grad[..., :-ctx.width], tail), dim=-1), None, None


def sum_rope_key_grad(wkv_a: nn.Module, tp_mesh: DeviceMesh, rope: int) -> None:
    """On ``wkv_a`` (output: kv_lora_rank latent channels, then the rotary key of ``rope`` channels): the rotary key
    is shared by all heads, and each tp rank's attention uses it with its own heads only, so its gradient is partial
    per rank; a forward hook sums it over tp in the backward (Megatron's ``f`` on that slice). The latent's gradient
    arrives whole already (``wkv_b``'s column-parallel input style reduced it), so it passes unchanged. A hook on the
    module, not a plan entry, so a LoRA-wrapped ``wkv_a`` (whose plan entries ``lora_tp`` splits) gets it too."""
    group = tp_mesh.get_group()
    wkv_a.register_forward_hook(lambda _mod, _inputs, out: _SumTail.apply(out, rope, group))


class SharedHidden(ParallelStyle):
    """Stacked shared experts (``workers.model.moe.SharedExperts``, w1/w3 [n, d, h], w2 [n, h, d]) split over tp
    by hidden units, as a column- then row-parallel SwiGLU: w1/w3 sharded on their hidden dim, w2 on its.

    It runs inside the replicated MoE layer (``moe_style``), so its input is the whole token batch as a plain
    tensor on every tp rank; it enters as a Replicate DTensor (the backward sums the input's partial gradients over
    tp) and leaves as the partial sums all-reduced, a plain tensor again."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _shard_hidden, _enter_replicated, _leave_summed)


def _shard_hidden(_name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Each stacked weight of ``module`` as a DTensor sharded on its hidden dim (``HIDDEN_DIM``)."""
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Shard(HIDDEN_DIM[name])]),
                                                     requires_grad=param.requires_grad))


def _enter_replicated(_module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """The layer's plain input, the same on every tp rank, as a Replicate DTensor."""
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


def _leave_summed(_module: nn.Module, output: DTensor, mesh: DeviceMesh):
    """The shared experts' output (partial sums over the hidden slices) reduced to a whole plain tensor."""
    return output.redistribute(mesh, [Replicate()]).to_local()


def apply_tensor_parallel(stage: DeepseekV3, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard ``stage`` (a whole model or one pipeline stage) over ``tp_mesh`` in place: the ends as Llama's, then
    every block by ``block_plan``."""
    llama_parallel.shard_ends(stage, tp_mesh, sequence_parallel)
    for block in stage.layers.values():
        apply_plan(block, tp_mesh, block_plan(block, sequence_parallel))
        sum_rope_key_grad(block.attention.wkv_a, tp_mesh, block.attention.cfg.qk_rope_head_dim)


def block_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """One block's plan (see the module docstring): Llama's norms, output projection and feed-forward, MLA's up
    projections column-parallel in place of q/k/v, and an MoE layer's shared experts split by hidden units. The
    attention's input arrives gathered as a plain tensor, for its replicated down projections."""
    moe, cfg = is_moe(block), block.attention.cfg
    plan = llama_parallel.block_plan(sequence_parallel, moe)
    for name in ("wq", "wk", "wv"):
        del plan[f"attention.{name}"]
    query = "attention.wq" if cfg.q_lora_rank is None else "attention.wq_b"
    plan.update({
        "attention": PrepareModuleInput(input_layouts=(activation_layout(sequence_parallel),),
                                        desired_input_layouts=(Replicate(),), use_local_output=True),
        query: ColwiseParallel(), "attention.wkv_b": ColwiseParallel(),
    })
    if moe and block.feed_forward.shared is not None:
        plan["feed_forward.shared"] = SharedHidden()
    return plan
