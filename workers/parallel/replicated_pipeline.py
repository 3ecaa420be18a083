"""PipeDream's stage replication, synchronous: each stage on its own number of ranks, microbatches dealt to a
stage's replicas round-robin (``workers.contract.stage_replicas``), our own GPipe-order executor over point-to-point
sends.

Why our own: every schedule in ``torch.distributed.pipelining`` pairs stage ``s`` with exactly one rank (a
``PipelineStage`` has one ``prev``/``next`` peer and a schedule hands microbatch ``i`` to the same stage object as
every other), so a stage held by 2 ranks next to one held by 1 has no expression there: microbatch ``m`` must go
from replica ``m mod r_s`` to replica ``m mod r_(s+1)``, a peer that changes with ``m``. Here every rank runs its
own stage's share of the microbatches, in GPipe's order: all its forwards (in increasing ``m``), then all its
backwards (decreasing ``m``); an activation goes to the next stage's owner of ``m`` and its gradient comes back
from it. Sends are non-blocking and each pair of ranks sends and receives its microbatches in the same order, so the
order cannot deadlock: the forward of ``(s, m)`` waits only on ``(s-1, m)`` and on ``(s, m')`` for ``m' < m``.

Synchronous, as GPipe and PipeDream-flush (the seed's 1F1B with a flush), not PipeDream's original asynchronous
weight stashing: every microbatch of a step runs on the same weights, the replicas of a stage sum their gradients
(each microbatch's loss is already its 1/m share) and average them over dp in one all-reduce before the one
optimizer step, so the update equals one process's over the whole batch.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from workers.contract.grid import Grid
from workers.contract.stage_replicas import StageReplicas
from workers.model.documents import attending
from workers.optim.build import clip_to_norm

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_DIMS = 6


def stage_groups(grid: Grid, replicas: StageReplicas, timeout_s: float) -> list:
    """One process group per stage over every rank that holds it (its replicas in every dp replica). Every rank
    creates every group, in stage order, as ``new_group`` requires."""
    timeout = timedelta(seconds=timeout_s)
    groups = []
    for stage in range(replicas.n_stages):
        held = range(replicas.first_position(stage), replicas.first_position(stage + 1))
        ranks = [grid.rank_of(dp=d, pp=p) for d in range(grid.dp) for p in held]
        groups.append(dist.new_group(ranks, timeout=timeout))
    return groups


class ReplicatedPipeline:
    """This rank's replica of one stage: its microbatches' forwards and backwards (``run``), then the stage's
    gradient and loss reduction (``reduce``) and the global norm (``clip``).

    ``events`` (F and B per microbatch, with this rank's ``stage`` and ``replica``) feed the timeline and the bubble,
    and show which replica ran each microbatch.
    """

    def __init__(self, module: nn.Module, replicas: StageReplicas, pp_rank: int, microbatches: int, loss_fn,
                 pp_group, stage_group, dp: int, device: torch.device):
        self.module, self.replicas, self.loss_fn, self.device = module, replicas, loss_fn, device
        self.stage, self.replica = replicas.stage_of(pp_rank)
        self.microbatches, self.mine = microbatches, replicas.microbatches_of(self.stage, self.replica, microbatches)
        self.first, self.last = self.stage == 0, self.stage == replicas.n_stages - 1
        self.pp_group, self.stage_group, self.dp = pp_group, stage_group, dp
        self.events: list[dict] = []

    # -- point to point ------------------------------------------------------------------------------

    def _peer(self, stage: int, microbatch: int) -> int:
        """The global rank that runs ``microbatch`` on ``stage`` in this rank's pipeline."""
        return dist.get_global_rank(self.pp_group, self.replicas.position_for(stage, microbatch))

    def _send(self, tensor: torch.Tensor, peer: int, pending: list) -> None:
        tensor = tensor.detach().contiguous()
        pending.append((dist.isend(tensor, peer), tensor))

    def _send_activation(self, out: torch.Tensor, peer: int, pending: list) -> None:
        """The activation after a header of its dtype and shape: the next stage's input shape is not known ahead
        (a last partial microbatch, an autocast dtype)."""
        if out.dim() > _MAX_DIMS:
            raise ValueError(f"a stage output of {out.dim()} dims does not fit the header ({_MAX_DIMS} at most)")
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        header[0], header[1] = _DTYPES.index(out.dtype), out.dim()
        header[2:2 + out.dim()] = torch.tensor(out.shape)
        self._send(header, peer, pending)
        self._send(out, peer, pending)

    def _recv_activation(self, peer: int) -> torch.Tensor:
        header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        dist.recv(header, peer)
        x = torch.empty(header[2:2 + int(header[1])].tolist(), dtype=_DTYPES[int(header[0])], device=self.device)
        dist.recv(x, peer)
        return x

    # -- one step ------------------------------------------------------------------------------------

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, documents: list) -> torch.Tensor | None:
        """Forward every microbatch this replica owns, then backward them in reverse; the summed loss shares of
        its microbatches on the last stage (reduced over the replicas by ``reduce``), else None."""
        xs = inputs.chunk(self.microbatches) if self.first else None
        ys = targets.chunk(self.microbatches) if self.last else None
        pending, held, losses = [], {}, []
        for m in self.mine:
            x = xs[m] if self.first else self._recv_activation(self._peer(self.stage - 1, m)).requires_grad_()
            start = time.time()
            with attending([self.module], documents[m] if documents else None):
                out = self.module(x)
            if self.last:
                out = self.loss_fn(out, ys[m])
                losses.append(out.detach().float())
            else:
                self._send_activation(out, self._peer(self.stage + 1, m), pending)
            held[m] = (x, out)
            self._record("F", m, start)
        for m in reversed(self.mine):
            x, out = held.pop(m)
            grad = None
            if not self.last:
                grad = torch.empty_like(out)
                dist.recv(grad, self._peer(self.stage + 1, m))
            start = time.time()
            with attending([self.module], documents[m] if documents else None):  # recompute replays the forward
                torch.autograd.backward(out, grad)
            if not self.first:
                self._send(x.grad, self._peer(self.stage - 1, m), pending)
            self._record("B", m, start)
        for work, _ in pending:
            work.wait()
        return torch.stack(losses).sum() if self.last else None

    def _record(self, kind: str, microbatch: int, start: float) -> None:
        self.events.append({"stage": self.stage, "replica": self.replica, "microbatch": microbatch, "kind": kind,
                            "start": start, "end": time.time()})

    # -- after backward ------------------------------------------------------------------------------

    def reduce(self, params: list[nn.Parameter], loss: torch.Tensor | None) -> torch.Tensor | None:
        """Sum the stage's gradients (and on the last stage its loss shares) over the stage's replicas and average
        them over dp, in one flat all-reduce: each replica summed only its own microbatches' shares."""
        trained = [p for p in params if p.requires_grad]
        if dist.get_world_size(self.stage_group) > 1:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in trained]
            parts = [g.reshape(-1).float() for g in grads] + ([loss.reshape(1)] if loss is not None else [])
            flat = torch.cat(parts).div_(self.dp)
            dist.all_reduce(flat, group=self.stage_group)
            sizes = [g.numel() for g in grads] + ([1] if loss is not None else [])
            pieces = flat.split(sizes)
            for p, g in zip(trained, pieces):
                p.grad = g.view_as(p).to(p.dtype)
            if loss is not None:
                loss = pieces[-1].reshape(())
        return loss

    def clip(self, params: list[nn.Parameter], max_norm: float) -> float:
        """The global gradient norm, each stage counted once (its replica 0's squares, summed over the pipeline),
        and the clip to ``max_norm`` (0: none)."""
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.replica == 0:
            for p in params:
                if p.grad is not None:
                    squares = squares + p.grad.float().pow(2).sum()
        dist.all_reduce(squares, group=self.pp_group)
        return clip_to_norm(params, max_norm, math.sqrt(float(squares)))
