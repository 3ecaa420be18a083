"""``parallel.dp_sync: diloco``: DiLoCo (Douillard et al. 2023), data-parallel replicas that meet every H steps.

Each data-parallel replica steps the job's own optimizer (the inner one, AdamW in the paper) on its own share of
every global batch, with no gradient crossing the dp group (``parallelize.build_parts`` builds no gradient
buckets). Every ``diloco_inner_steps`` (H) steps the replicas meet: the pseudo-gradient ``theta_outer -
theta_local`` is averaged over dp in one all-reduce, the outer optimizer (PyTorch's SGD with Nesterov momentum)
steps ``theta_outer`` with it, and every replica takes ``theta_outer`` as its weights. The inner optimizers' state
stays each replica's own. The dp traffic is one weight-sized all-reduce per H steps instead of a gradient-sized
one per step.

Checkpoints and snapshots carry ``theta_outer`` and the outer momentum (``OuterStep.state_dict``), and each
replica's own weights and inner optimizer state under its own names (``TrainState.replica``): a save may fall
mid-round, when the replicas' weights and moments differ, and saving only at the outer steps would leave the
inner moments (which differ at every step) behind; so any step resumes bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.model.names import unwrap
from workers.state.train_state import replica_prefix
from workers.step.context import StepContext, StepKit
from workers.step.engine import GradSync


class OuterStep:
    """``theta_outer`` and its Nesterov SGD for one rank's model parts (this pipeline stage's parameters)."""

    def __init__(self, kit: StepKit):
        par = kit.spec.parallel
        self.group, self.dp = kit.dp_group, par.dp
        self.local = {n: p for m in kit.state.modules for n, p in unwrap(m).named_parameters()}
        self.outer = {n: p.detach().clone() for n, p in self.local.items()}
        self.opt = torch.optim.SGD(list(self.outer.values()), lr=par.diloco_outer_lr,
                                   momentum=par.diloco_outer_momentum, nesterov=par.diloco_outer_momentum > 0)
        for t in self.outer.values():  # zeros: SGD's first step then keeps momentum*0 + delta = delta, as its own
            self.opt.state[t]["momentum_buffer"] = torch.zeros_like(t)  # start, and a checkpoint has a buffer

    @torch.no_grad()
    def sync(self) -> None:
        """Average ``theta_outer - theta_local`` over the replicas (one flat all-reduce), step the outer optimizer
        with it and hand every replica the new ``theta_outer``."""
        names = list(self.outer)
        delta = torch.cat([(self.outer[n] - self.local[n]).reshape(-1) for n in names])
        dist.all_reduce(delta, group=self.group)
        delta /= self.dp
        for n, piece in zip(names, delta.split([self.outer[n].numel() for n in names])):
            self.outer[n].grad = piece.view_as(self.outer[n])
        self.opt.step()
        for n in names:
            self.outer[n].grad = None
            self.local[n].copy_(self.outer[n])

    def state_dict(self) -> dict:
        """``theta_outer`` and the outer momentum by global parameter name (the same on every replica)."""
        return {"outer": dict(self.outer),
                "momentum": {n: self.opt.state[t]["momentum_buffer"] for n, t in self.outer.items()}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Copy a saved ``state_dict`` (a DCP load into ours in place, or a snapshot's host copy) back."""
        for n, t in self.outer.items():
            t.copy_(state["outer"][n])
            self.opt.state[t]["momentum_buffer"].copy_(state["momentum"][n])

    def host_copy(self) -> dict:
        """A host copy of ``state_dict`` for an in-memory snapshot."""
        return {k: {n: t.to("cpu", copy=True) for n, t in d.items()} for k, d in self.state_dict().items()}


class DiLoCoSync(GradSync):
    """The all-reduce path's clip and update on this replica's own gradients (nothing reduced them over dp), then
    the outer step after every ``diloco_inner_steps``-th update."""

    def __init__(self, kit: StepKit):
        super().__init__(kit)
        self.every = kit.spec.parallel.diloco_inner_steps
        self.outer = OuterStep(kit)
        kit.state.outer = self.outer
        kit.state.replica = replica_prefix(kit.mesh['dp'].get_local_rank())

    def update(self, applied: bool, ctx: StepContext) -> None:
        super().update(applied, ctx)
        if self.state.step % self.every == 0:
            self.outer.sync()
