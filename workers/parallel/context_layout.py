"""Context parallelism outside the kernels: which tokens a cp rank holds and how the model is told.

Each cp rank holds two of the sequence's ``2*cp`` chunks (``zigzag_indices``: chunk ``r`` and chunk
``2*cp-1-r``), so causal attention costs every rank the same. Everything that depends on a token's place in
the sequence must then use its *global* position: the data cursor slices inputs and targets alike
(``split_sequence``), learned position embeddings and rotary angles read ``ContextShard.positions``, and the
attention core calls the kernel ``parallel.cp_impl`` names (``workers.parallel.context_parallel``).

The model learns of all this through one attribute: every module with a ``context_shard`` attribute (the GPT
root and the attention cores of ``workers.model.gpt`` / ``llama``) gets the rank's ``ContextShard``; with
``None`` (cp=1, the reference) the model runs as before. Weights are replicated over cp, so their gradients
are reduced over dp x cp (``workers.parallel.process_group.data_parallel_mesh``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from workers.parallel import context_parallel

KERNELS = {
    "ring": "ring_attention",
    "ulysses": "ulysses_attention",
    "allgather": "allgather_attention",
}


@dataclass(frozen=True)
class ContextShard:
    """One cp rank's share of the sequence and the attention kernel that joins the shares."""

    group: context_parallel.GroupRef  # the cp process group, by name (what a compiled block can carry)
    size: int
    rank: int
    impl: str

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens (what embeddings and rotary must use)."""
        return context_parallel.zigzag_indices(local_len * self.size, self.size, self.rank).to(device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **documents) -> torch.Tensor:
        """Causal attention of the local queries over the whole sequence, by the ``cp_impl`` kernel; with
        ``documents`` (a ``workers.model.documents.Documents``), causal within each document, with ``window``
        within the sliding window, and with ``sinks`` (gpt-oss) each head's sink logit in every row (every kernel)."""
        kernel = getattr(context_parallel, KERNELS[self.impl])
        return kernel(q, k, v, self.group, causal=True, **documents)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, impl: str) -> ContextShard:
    """Hand ``model`` (a whole model or a pipeline stage) this rank's ``ContextShard``, in place."""
    group = context_parallel.group_ref(cp_mesh.get_group())
    shard = ContextShard(group, cp_mesh.size(), cp_mesh.get_local_rank(), impl)
    for module in model.modules():
        if hasattr(module, "context_shard"):
            module.context_shard = shard
    return shard


def split_sequence(tokens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This cp rank's tokens of ``tokens`` [batch, seq] in zigzag order (inputs and targets alike)."""
    if cp == 1:
        return tokens
    return tokens[:, context_parallel.zigzag_indices(tokens.shape[1], cp, rank)]
