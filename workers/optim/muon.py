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
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from parameter_server.optimizers import decay_for
from workers.contract.sections import OptimSection
from workers.model.lora import ADAPTER_NAMES


def muon_owns(name: str, param: torch.Tensor) -> bool:
    """Whether Muon steps ``name``: the 2-D weights inside the blocks (``layers.<i>.``: attention and feed-forward
    projections, the MoE router). Outside the blocks live the embeddings, the final norm and the output head, whose
    rows are looked up or scored one token at a time (an orthogonalised update does not fit them); inside, norm
    weights and biases are 1-D and expert stacks 3-D. LoRA's adapters are 2-D but low-rank factors of one update
    (orthogonalising each apart is not Muon's update of their product): AdamW, as PEFT trains them (the spec refuses
    muon with LoRA, which would leave Muon nothing). A DTensor's ``dim()`` is its parameter's."""
    return name.startswith("layers.") and param.dim() == 2 and name.rsplit(".", 2)[-2] not in ADAPTER_NAMES


class WholeMatrixMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose Newton-Schulz iteration sees each matrix whole, run once per matrix by its owner.

    Why whole: on a sharded DTensor (FSDP2's dim-0 shards under ZeRO-2/3, TP's row or column shards) PyTorch's Muon
    runs its matmuls through DTensor, which sums bf16 partial products across ranks: 2.7% off the single-process
    update in a 2-rank check. Why an owner (Moonlight's distributed Muon): gathering every matrix on every rank and
    orthogonalising it there repeats the iteration on each rank of the group, N-fold at dp=N.

    So a step is three phases over all the matrices (``_Matrix``): each rank applies the momentum and Nesterov's
    look-ahead to its own shard (elementwise, so the same bits as on the whole matrix); the shards of each look-ahead
    are gathered in bf16 (Newton-Schulz's first act is that cast, so nothing changes) and the matrix's owner, one
    rank of the group it is sharded over chosen by size (``owners``), keeps it; every rank orthogonalises only its own
    matrices, in parallel; each result then goes back as the owner's partial sum over zeros, which DTensor turns into
    a reduce-scatter (each rank receives its shard: exact, a sum with zeros), and each rank decays and moves its shard.
    Gradients that data parallelism replicated (ZeRO-0's plain tensors over ``replicated_group``) split the same way
    when ``split_replicated`` (the owner broadcasts), else every rank repeats the iteration without communicating.

    The math is PyTorch's: the owner calls ``torch.optim._muon._zeropower_via_newtonschulz`` with the group's
    coefficients, steps and eps, and the rate is its ``_adjust_lr``; the elementwise steps around them are applied
    in ``_single_tensor_muon``'s order and ops, so one process reproduces ``torch.optim.Muon`` bit for bit
    (tests/unit/test_muon.py) and every layout the single-process update (tests/integration/test_muon_parity.py).
    """

    def __init__(self, params, *, replicated_group=None, split_replicated: bool = True, **kwargs):
        super().__init__(params, **kwargs)
        self.replicated_group = replicated_group if split_replicated else None
        self._owners: dict[int, int] | None = None  # id(param) -> its owner's index in its group

    @torch.no_grad()
    def step(self, closure=None):
        loss = torch.enable_grad()(closure)() if closure is not None else None
        matrices = [m for group in self.param_groups for m in self._looked_ahead(group)]
        for m in matrices:
            m.gather()
        for m in matrices:
            m.orthogonalise()
        for m in matrices:
            m.apply()
        return loss

    def _looked_ahead(self, group: dict) -> list[_Matrix]:
        """``group``'s matrices with a gradient, their momentum buffers stepped and look-ahead taken on this rank's
        shard (as ``_single_tensor_muon``)."""
        if self._owners is None:
            self._owners = owners([p for g in self.param_groups for p in g["params"]], self.replicated_group)
        out = []
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = _without_partial(p.grad)
            state = self.state[p]
            if "momentum_buffer" not in state:  # not setdefault: that would allocate a zero matrix every step
                state["momentum_buffer"] = torch.zeros_like(grad)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - group["momentum"])
            update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            out.append(_Matrix(p, update, group, self._owners[id(p)], self.replicated_group))
        return out


class _Matrix:
    """One matrix through a step: its look-ahead (this rank's shard), gathered whole on its owner, orthogonalised
    there, and back as this rank's shard of the orthogonal update."""

    def __init__(self, param: torch.Tensor, update: torch.Tensor, group: dict, owner: int, replicated_group):
        self.param, self.update, self.group, self.owner = param, update, group, owner
        self.process_group = None if isinstance(param, DTensor) else replicated_group
        self.mine = _my_index(param, self.process_group) == owner

    def gather(self) -> None:
        """The whole look-ahead in bf16 on the owner (all-gathered over a DTensor's mesh, kept by the owner alone)."""
        if isinstance(self.update, DTensor):
            whole = _replicated(self.update.bfloat16()).to_local()
            self.update = whole if self.mine else None
        elif not self.mine:
            self.update = None

    def orthogonalise(self) -> None:
        """PyTorch's Newton-Schulz on the owner's matrices."""
        if self.mine:
            g = self.group
            self.update = _zeropower_via_newtonschulz(self.update, g["ns_coefficients"], g["ns_steps"], g["eps"])

    def apply(self) -> None:
        """This rank's shard of the orthogonal update from the owner, then PyTorch's decay and step on the shard."""
        ortho = self._received()
        g = self.group
        self.param.mul_(1 - g["lr"] * g["weight_decay"])
        self.param.add_(ortho, alpha=-_adjust_lr(g["lr"], g["adjust_lr_fn"], self.param.shape))

    def _received(self) -> torch.Tensor:
        """The owner's update as this rank holds the parameter: the shard of a DTensor (a reduce-scatter of the
        owner's matrix summed with the others' zeros), the whole matrix of a split replicated one (a broadcast)."""
        p = self.param
        if isinstance(p, DTensor):
            local = self.update.contiguous() if self.mine else torch.zeros(p.shape, dtype=torch.bfloat16,
                                                                           device=p.to_local().device)
            mesh = p.device_mesh
            return DTensor.from_local(local, mesh, [Partial()] * mesh.ndim).redistribute(mesh, p.placements)
        if self.process_group is None:
            return self.update
        whole = self.update.contiguous() if self.mine else torch.empty(p.shape, dtype=torch.bfloat16, device=p.device)
        dist.broadcast(whole, group=self.process_group, group_src=self.owner)
        return whole


def owners(params: list[torch.Tensor], replicated_group=None) -> dict[int, int]:
    """id(param) -> the index of the rank that orthogonalises it, within the ranks that share it (a DTensor's mesh;
    ``replicated_group`` for plain tensors, or this rank alone). Size-balanced (longest first, each to the least
    loaded rank, by Newton-Schulz's cost rows·cols·min(rows, cols)): the blocks' matrices come in a few sizes,
    and round-robin would give one rank every wide feed-forward matrix when their count divides the group's size.
    The same on every rank of a group: it reads only shapes and the parameters' order."""
    out: dict[int, int] = {}
    by_group: dict[object, list[torch.Tensor]] = {}
    for p in params:
        by_group.setdefault(p.device_mesh if isinstance(p, DTensor) else replicated_group, []).append(p)
    for key, members in by_group.items():
        load = [0] * _group_size(key)
        for p in sorted(members, key=lambda q: -_ns_cost(q.shape)):  # sorted() is stable: ties keep their order
            rank = load.index(min(load))
            load[rank] += _ns_cost(p.shape)
            out[id(p)] = rank
    return out


def _ns_cost(shape: torch.Size) -> int:
    rows, cols = shape
    return rows * cols * min(rows, cols)


def _group_size(key) -> int:
    """Ranks of a DTensor mesh, of a process group, or 1 (None: this rank alone)."""
    if isinstance(key, DeviceMesh):
        return key.size()
    return 1 if key is None else dist.get_world_size(key)


def _my_index(param: torch.Tensor, process_group) -> int:
    """This rank's index among those sharing ``param`` (the order ``owners`` counts in)."""
    if isinstance(param, DTensor):
        return param.device_mesh.mesh.flatten().tolist().index(dist.get_rank())
    return 0 if process_group is None else dist.get_rank(process_group)


def _without_partial(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with any pending partial sum reduced (a momentum step is not linear in bf16 pieces' rounding)."""
    if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
        return grad.redistribute(grad.device_mesh, [Replicate() if pl.is_partial() else pl for pl in grad.placements])
    return grad


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


def muon_optimizer(matrices: list[torch.Tensor], optim: OptimSection, replicated_group=None) -> WholeMatrixMuon:
    """``WholeMatrixMuon`` over ``matrices`` (``muon_owns``'), one param group each, at ``optim.weight_decay``
    (decoupled, as AdamW's; every matrix decays under either ``weight_decay_exclude`` rule). The rate is scaled per
    matrix shape as Moonlight's (``match_rms_adamw``: 0.2·sqrt(max(rows, cols))), so the update's RMS is AdamW's
    and the AdamW part's ``optim.lr`` and ``weight_decay`` carry over; Keller Jordan's ``original`` scaling wants a
    rate 10-50x AdamW's, which one ``optim.lr`` for both parts cannot give, so it is not offered."""
    decay = [decay_for(optim.weight_decay, optim.weight_decay_exclude, p.dim()) for p in matrices]
    return WholeMatrixMuon([{"params": [p], "weight_decay": d} for p, d in zip(matrices, decay, strict=True)],
                           replicated_group=replicated_group, lr=optim.lr, momentum=optim.muon_momentum,
                           nesterov=optim.muon_nesterov, ns_steps=optim.muon_ns_steps, adjust_lr_fn="match_rms_adamw")
