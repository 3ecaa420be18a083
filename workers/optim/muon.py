"""``optim.name: muon``: PyTorch's Muon for the transformer blocks' matrices, AdamW for every other parameter.

Muon (Keller Jordan; "Muon is Scalable for LLM Training", Moonlight) orthogonalises each matrix's momentum by a
Newton-Schulz iteration, which is only defined for 2-D weights of hidden layers: the embeddings, the output head,
norm weights and biases train with AdamW, as Moonlight and Keller Jordan's reference do. So a muon job has two
PyTorch optimizers over disjoint parameters, held as one (``Hybrid``) where the trainer, the LR schedulers, DCP
checkpoints and snapshots hold one optimizer per model part.

MoE expert stacks are 3-D (``[experts, out, in]``): ``torch.optim.Muon`` refuses them, and stepping each expert's
matrix would mean copying its update loop, so they train with AdamW (the router's 2-D weight gets Muon).
"""

from __future__ import annotations

from collections import ChainMap

import torch
from torch.distributed.tensor import DTensor, Replicate

from parameter_server.optimizers import decay_for


def muon_owns(name: str, param: torch.Tensor) -> bool:
    """Whether Muon steps ``name``: the 2-D weights inside the blocks (``layers.<i>.``: attention and feed-forward
    projections, the MoE router). Outside the blocks live the embeddings, the final norm and the output head, whose
    rows are looked up or scored one token at a time (an orthogonalised update does not fit them); inside, norm
    weights and biases are 1-D and expert stacks 3-D. A DTensor's ``dim()`` is its parameter's."""
    return name.startswith("layers.") and param.dim() == 2


class WholeMatrixMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose Newton-Schulz iteration sees each matrix whole on every layout.

    Why: on a sharded DTensor (FSDP2's dim-0 shards under ZeRO-2/3, TP's row or column shards) PyTorch's Muon runs
    its matmuls through DTensor, which sums bf16 partial products across ranks: 2.7% off the single-process update
    in a 2-rank check. Here each sharded gradient and momentum buffer is gathered (``Replicate``) for the step, so
    the update is PyTorch's on the whole matrix, the same on every rank as on one process; the parameter keeps its
    shard (a replicated update added to a shard is sliced locally) and the buffer goes back to its shard right after.
    One param group per matrix (``muon_optimizer``) keeps one gathered matrix alive at a time: ``Muon.step`` prepares
    a group (``_init_group``) only after the previous group's update ran.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._gathered: list[tuple[DTensor, DTensor]] = []  # (buffer's shard, its whole copy) of the group in step

    def _init_group(self, group, params_with_grad, grads, muon_momentum_bufs):
        """PyTorch's preparation of ``group``, then its sharded gradients and buffers gathered whole."""
        self._reshard()
        has_complex = super()._init_group(group, params_with_grad, grads, muon_momentum_bufs)
        for i, grad in enumerate(grads):
            if isinstance(grad, DTensor):
                whole = _replicated(muon_momentum_bufs[i])
                self._gathered.append((muon_momentum_bufs[i], whole))
                grads[i], muon_momentum_bufs[i] = _replicated(grad), whole
        return has_complex

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        self._reshard()
        return loss

    def _reshard(self) -> None:
        """The stepped whole buffers back into their shards (a local slice: no communication)."""
        for shard, whole in self._gathered:
            shard.copy_(whole.redistribute(shard.device_mesh, shard.placements))
        self._gathered.clear()


def _replicated(tensor: DTensor) -> DTensor:
    """``tensor`` whole on every rank of its mesh (an all-gather of shards, an all-reduce of partial sums)."""
    return tensor.redistribute(tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim)


class _States(ChainMap):
    """The parts' per-parameter states read through as one mapping. Why not a plain ``ChainMap``: the parts' states
    are ``defaultdict``s, and a ``ChainMap`` lookup of the second part's parameter would insert an empty state
    into the first part's (and return it), so the AdamW part's moments never reached a checkpoint."""

    def __getitem__(self, key):
        for mapping in self.maps:
            if key in mapping:
                return mapping[key]
        return self.__missing__(key)


class Hybrid(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, seen as one: its ``param_groups`` are theirs (the same dicts, so
    an LR scheduler's rate and a resume's hyperparameters reach them), its ``state`` reads through to theirs,
    ``step`` steps each, and its state dict is theirs end to end (parameters numbered across them, as DCP's
    flattened optimizer state names each by its parameter)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        super().__init__([g for o in optimizers for g in o.param_groups], {})
        self._join()

    def _join(self) -> None:
        """Point ``param_groups`` and ``state`` at the parts' (again after a load, which replaces theirs)."""
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]
        self.state = _States(*(o.state for o in self.optimizers))

    @torch.no_grad()
    def step(self, closure=None):
        loss = torch.enable_grad()(closure)() if closure is not None else None
        for opt in self.optimizers:
            opt.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """Each part takes its own groups (in order) and the state of their parameters, renumbered from 0."""
        groups, state = iter(state_dict["param_groups"]), state_dict["state"]
        for opt in self.optimizers:
            mine = [next(groups) for _ in opt.param_groups]
            ids = {i: n for n, i in enumerate(i for g in mine for i in g["params"])}
            opt.load_state_dict({"state": {n: state[i] for i, n in ids.items() if i in state},
                                 "param_groups": [{**g, "params": [ids[i] for i in g["params"]]} for g in mine]})
        self._join()


def muon_optimizer(matrices: list[torch.Tensor], optim: dict) -> WholeMatrixMuon:
    """``WholeMatrixMuon`` over ``matrices`` (``muon_owns``'), one param group each, at ``optim.weight_decay``
    (decoupled, as AdamW's; every matrix decays under either ``weight_decay_exclude`` rule). The rate is scaled per
    matrix shape as Moonlight's (``match_rms_adamw``: 0.2·sqrt(max(rows, cols))), so the update's RMS is AdamW's
    and the AdamW part's ``optim.lr`` and ``weight_decay`` carry over; Keller Jordan's ``original`` scaling wants a
    rate 10-50x AdamW's, which one ``optim.lr`` for both parts cannot give, so it is not offered."""
    return WholeMatrixMuon([{"params": [p], "weight_decay": decay_for(optim, p.dim())} for p in matrices],
                           lr=optim["lr"], momentum=optim["muon_momentum"], nesterov=optim["muon_nesterov"],
                           ns_steps=optim["muon_ns_steps"], adjust_lr_fn="match_rms_adamw")
