"""``train.compile``: each transformer block compiled with ``torch.compile`` in place, as torchtitan does.

Why per block and in place: the blocks of a model are the same code on the same shapes, so Dynamo traces
one and reuses the graph for the rest (a tiny Llama's 4 blocks cost one compile on CPU), and a graph break
or recompile stays inside one block. ``nn.Module.compile`` keeps the module where it is, so parameter names
stay the same (no ``_orig_mod.`` prefix from wrapping in ``torch.compile(module)``): meta-init, Hugging Face
I/O, ZeRO-1 slices, parameter-server keys and checkpoints are all keyed on those names.

How it composes (measured on torch 2.13, CPU, inductor, gloo; not tried on 2.11 or a GPU):

- ``nn.Module.compile`` compiles ``_call_impl``, which Dynamo skips: each frame it calls (every forward
  pre-hook, ``forward``, every forward hook) is compiled on its own, ``fullgraph`` each.
- FSDP2's hooks are ``torch._dynamo.disable``d, so they run eagerly around the compiled ``forward``: the
  builder compiles before ``fully_shard`` (torchtitan's order; after it also worked, on one rank).
- Recompute: the composable ``checkpoint``'s hooks enter a generator context that Dynamo cannot trace, so
  with compile the builder recomputes through ``torch.utils.checkpoint`` called from ``forward``
  (``workers.parallel.recompute``), which Dynamo turns into its activation-checkpoint operator.
- TP's DTensor plans (hooks on a block's submodules) are traced inside the block's ``forward``. What enters
  the first block is an ``AsyncCollectiveTensor`` (the embedding's all-reduce or reduce-scatter, not yet
  waited on); a compiled block taking one hands the eager redistribute before it a plain gradient in backward
  (AttributeError ``'_local_tensor'`` on torch 2.13), so an eager pre-hook waits on it first (``_waited``).
- Attention under document masks, sliding windows and cp is a custom operator (``workers.model.attention_ops``):
  one node in the block's graph, its tile loop and its sends, receives and all-to-alls inside.
- MoE: a block holding an MoE layer compiles its other parts and leaves the layer eager (``_compile_around``).
- What does not trace is refused before start (``orchestrator/spec/checks/compile.py``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor, wait_tensor

from workers.model.moe import MoELayer
from workers.model.registry import ModelFamily


def compile_blocks(stage: nn.Module, family: ModelFamily, backend: str = "inductor") -> list[nn.Module]:
    """Compile each of ``stage``'s blocks (the family's ``blocks`` hook) in place, ``fullgraph``: a graph
    break is an error at the first step rather than a silently slower block. A block holding an MoE layer has
    its other parts compiled instead, the MoE layer left eager (``_compile_around``). Returns the blocks.
    ``backend``: inductor in training; tests of what Dynamo traces may skip its code generation (``aot_eager``)."""
    blocks = family.hook("blocks")(stage)
    eager_wait = torch.compiler.disable(_waited)  # here, not as a decorator: it imports Dynamo (~1 s a process)
    for block in blocks:
        _compile_around(block, eager_wait, backend)
    return blocks


def _compile_around(module: nn.Module, eager_wait, backend: str = "inductor") -> None:
    """Compile ``module`` in place, or, where it holds an MoE layer, each of its children that holds none
    (attention, norms, a dense feed-forward), recursing into the others, so the MoE layers alone run eagerly.

    Why the MoE layer stays eager: its routing is data-dependent all the way through (per-expert row counts read
    on the host to size the all-to-all splits and the per-expert loop, noise drawn per sequence from seeded host
    generators, step tallies moved to the host, the recompute test of autograd's state), so a graph over it
    would break at every one of these or recompile for every new count. The dense parts around it are where
    compiling pays, and each compiles whole (``fullgraph``), as torchtitan compiles an MoE block's parts.
    """
    if not any(isinstance(m, MoELayer) for m in module.modules()):
        module.register_forward_pre_hook(eager_wait)
        module.compile(fullgraph=True, backend=backend)
        return
    for child in module.children():
        if not isinstance(child, MoELayer):
            _compile_around(child, eager_wait, backend)


def _waited(module: nn.Module, args: tuple) -> tuple:
    """A block's inputs with pending collectives waited on (see the module docstring); run eagerly
    (``compile_blocks`` registers it through ``torch.compiler.disable``)."""
    return tuple(wait_tensor(a) if isinstance(a, AsyncCollectiveTensor) else a for a in args)


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs through ``torch.compile`` (``nn.Module.compile`` was called on it)."""
    return getattr(module, "_compiled_call_impl", None) is not None
