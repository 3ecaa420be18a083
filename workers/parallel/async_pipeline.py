"""PipeDream's asynchronous pipelines: 1F1B with weight stashing (``pipedream``) and double-buffered weights
(``pipedream_2bw``), our own executor.

Why our own: every schedule in ``torch.distributed.pipelining`` flushes the pipeline and steps the optimizer once
after all microbatches; none updates a stage's weights between microbatches or keeps a microbatch's weights
until its backward. Here each stage runs the 1F1B order over plain ``dist.isend``/``irecv`` on the pp group and
owns a ``WeightVersions``: the forward of a microbatch runs (``torch.func.functional_call``) on a stashed copy
of the weight version it was given, its backward differentiates that same copy, and the gradient lands on the
live parameters the optimizer steps.

The rules, as in Narayanan et al. (PipeDream, 2019; PipeDream-2BW, 2021):

- ``pipedream``: a stage updates its weights after every microbatch's backward (a window of 1). A forward uses
  the stage's newest version (or, with vertical sync, the version the first stage used, sent with the
  activation), and its backward the same stashed copy.
- ``pipedream_2bw``: a stage updates every ``every`` microbatches (m >= pp) with the gradient accumulated over
  them; every microbatch of window w runs on version max(0, w - 1), so W(t+1) = W(t) - lr * grad f(W(t-1)): the
  gradient is applied one version late and a stage holds two versions besides its live weights at most.

How a training step maps onto it: one step is ``train.microbatches`` microbatches (windows align with steps:
``every`` divides them). Inside the step there is no flush between updates: 1F1B warm-up, a steady state in
which forwards of later microbatches run on newer versions while older backwards still use theirs, then the
cool-down. The step ends with every stage's backwards done (a flush per step, so that a step's record, a
checkpoint and a recovery see a settled state). The LR schedule moves once per step; the loss recorded is the
mean of the step's microbatch losses, each on its own version. Clipping uses each stage's own gradient norm:
a norm over all stages would make every update wait for the slowest stage, which is what the schedule avoids.
The ``grad_norm`` reported is the norm, over all stages, of each stage's last update in the step.

Data parallelism: each update's gradient is averaged over the stage's dp group before the step (every replica
runs the same order, so the all-reduces pair up). Checkpoints: at a step boundary only ``pipedream_2bw`` has a
version besides the live weights still in use (the next window runs on it); ``state_dict`` carries it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from workers.optim.build import clip_grads
from workers.parallel.data_parallel import unwrap

_HEADER = 8  # version, ndim, up to 4 dims, dtype code, spare
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class WeightVersions:
    """One stage's weight versions: the live parameters (which the optimizer steps in place) and the stashed
    copies microbatches in flight (or about to start) run on. Version k is the weights after k updates."""

    def __init__(self, module: nn.Module, keep_previous: bool):
        named = [(n, p) for n, p in unwrap(module).named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.live = [p for _, p in named]
        self.keep_previous = keep_previous  # stash the pre-update weights: a later forward may still ask for them
        self.current = 0
        self.stash: dict[int, list[torch.Tensor]] = {}

    def weights(self, version: int) -> list[torch.Tensor]:
        """The stashed tensors of ``version`` (copied from the live weights the first time it is asked for)."""
        if version not in self.stash:
            if version != self.current:
                raise RuntimeError(f"weight version {version} is gone (stage is at {self.current}, holds "
                                   f"{sorted(self.stash)}): the schedule asked for a version it did not keep")
            self.stash[version] = [p.detach().clone() for p in self.live]
        return self.stash[version]

    def before_update(self) -> None:
        """Called just before the optimizer steps the live weights in place: with ``keep_previous`` the version
        they hold now is copied first (2BW's next window, or a vertically synced microbatch, may still run on
        it); then the live weights are the next version."""
        if self.keep_previous:
            self.weights(self.current)
        self.current += 1

    def release(self, floor: int, in_flight: set[int]) -> None:
        """Drop every stashed version below ``floor`` that no microbatch in flight runs on."""
        for v in [v for v in self.stash if v < floor and v not in in_flight]:
            del self.stash[v]

    def held(self) -> dict:
        """How many versions are stashed now and their bytes (the timeline records it per event)."""
        per_version = sum(p.numel() * p.element_size() for p in self.live)
        return {"stashed": len(self.stash), "stash_bytes": len(self.stash) * per_version}


@dataclass(frozen=True)
class AsyncRules:
    """What differs between the two schedules: the update window and which version a microbatch runs on."""

    every: int  # microbatches per update (1: PipeDream; m: 2BW)
    follow_first_stage: bool  # later stages run the version the first stage chose (vertical sync; always in 2BW)
    one_version_late: bool  # 2BW: window w runs on version max(0, w - 1)

    def first_stage_version(self, microbatch: int, current: int) -> int:
        """The version the first stage runs global microbatch ``microbatch`` on."""
        if self.one_version_late:
            return max(0, microbatch // self.every - 1)
        return current

    def floor(self, current: int, newest_seen: int) -> int:
        """The oldest version a microbatch not yet started at this stage may still run on: 2BW's window after
        this stage's last update runs on the version before it; with vertical sync versions arrive in order,
        so none older than the newest one seen; else every forward takes the newest."""
        if self.one_version_late:
            return max(0, current - 1)
        return newest_seen if self.follow_first_stage else current


def rules_for(schedule: str, every: int, vertical_sync: bool) -> AsyncRules:
    """The rules of ``schedule``: ``every`` is 2BW's m (PipeDream updates after every microbatch)."""
    if schedule == "pipedream_2bw":
        return AsyncRules(every=every, follow_first_stage=True, one_version_late=True)
    return AsyncRules(every=1, follow_first_stage=vertical_sync, one_version_late=False)


def one_f_one_b(stage: int, n_stages: int, microbatches: int) -> list[tuple[str, int]]:
    """A stage's order of forwards and backwards: pp - s - 1 warm-up forwards, then one forward and one
    backward in turn, then the remaining backwards (the non-interleaved 1F1B order)."""
    warm = min(n_stages - stage - 1, microbatches)
    order = [("F", j) for j in range(warm)]
    for i in range(microbatches - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", j) for j in range(microbatches - warm, microbatches)]


class AsyncPipeline:
    """One pp rank's stage under an asynchronous schedule: runs a step's microbatches and its updates.

    ``events`` (F and B per microbatch, each with the ``version`` it ran on) feed the timeline and the bubble,
    as ``TimedStage.events`` do for torch's schedules.
    """

    def __init__(self, module: nn.Module, stage: int, n_stages: int, microbatches: int, rules: AsyncRules,
                 optimizer, loss_fn, pp_group, dp_group, grad_clip: float, device: torch.device):
        self.module, self.stage, self.n_stages, self.rules = unwrap(module), stage, n_stages, rules
        self.microbatches = microbatches
        self.optimizer, self.loss_fn, self.grad_clip, self.device = optimizer, loss_fn, grad_clip, device
        self.pp_group, self.dp_group = pp_group, dp_group
        self.versions = WeightVersions(module, keep_previous=rules.follow_first_stage)
        self.events: list[dict] = []
        self._last_sq_norm = 0.0
        self._newest_seen = 0  # the version of the last forward (vertical sync: versions arrive in order)

    # -- point to point over the pp group ---------------------------------------------------------------

    def _peer(self, offset: int) -> int:
        return dist.get_global_rank(self.pp_group, self.stage + offset)

    def _send(self, tensor: torch.Tensor, offset: int, pending: list) -> None:
        tensor = tensor.contiguous()
        pending.append((dist.isend(tensor, self._peer(offset), group=self.pp_group), tensor))

    def _send_activation(self, out: torch.Tensor, version: int, pending: list) -> None:
        """The activation with a header (its version, shape and dtype), so the next stage needs no shape
        inference and, under vertical sync or 2BW, runs the version the first stage chose."""
        if out.dim() > 4:
            raise ValueError(f"a stage output of {out.dim()} dims does not fit the activation header (4 at most)")
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0], header[1] = version, out.dim()
        header[2:2 + out.dim()] = torch.tensor(out.shape)
        header[6] = _DTYPES.index(out.dtype)
        self._send(header, +1, pending)
        self._send(out.detach(), +1, pending)

    def _recv_activation(self) -> tuple[torch.Tensor, int]:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, self._peer(-1), group=self.pp_group)
        version, ndim = int(header[0]), int(header[1])
        x = torch.empty(header[2:2 + ndim].tolist(), dtype=_DTYPES[int(header[6])], device=self.device)
        dist.recv(x, self._peer(-1), group=self.pp_group)
        return x.requires_grad_(), version

    # -- one step ------------------------------------------------------------------------------------

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor | None:
        """Run step ``step``'s microbatches (global microbatch ids continue from earlier steps'); return the
        mean of their losses on the last stage, else None. The updates happen inside."""
        first, last, microbatches = self.stage == 0, self.stage == self.n_stages - 1, self.microbatches
        xs = inputs.chunk(microbatches) if first else None
        ys = targets.chunk(microbatches) if last else None
        base = step * microbatches
        saved: dict[int, tuple] = {}
        pending: list = []
        losses: list[torch.Tensor] = []
        for kind, j in one_f_one_b(self.stage, self.n_stages, microbatches):
            if kind == "F":
                version, start = self._forward(j, base + j, xs, ys, saved, losses, pending)
            else:
                version, start = self._backward(j, base + j, saved, pending)
            self.events.append({"stage": self.stage, "microbatch": j, "kind": kind, "version": version,
                                "start": start, "end": time.time(), **self.versions.held()})
        for work, _ in pending:
            work.wait()
        current = self.versions.current  # the next step's first forward runs on the newest version (2BW: one late)
        self.versions.release(self.rules.floor(current, current), set())
        return torch.stack(losses).sum() / microbatches if last else None

    def _forward(self, j: int, n: int, xs, ys, saved: dict, losses: list, pending: list) -> tuple[int, float]:
        """Forward of microbatch ``j`` (global ``n``); returns its version and when its compute started (after
        the activation arrived: waiting on a neighbour is bubble, not work)."""
        if xs is not None:
            x, version = xs[j], self.rules.first_stage_version(n, self.versions.current)
        else:
            x, version = self._recv_activation()
            if not self.rules.follow_first_stage:
                version = self.versions.current
        self._newest_seen = version
        start = time.time()
        weights = [w.detach().requires_grad_() for w in self.versions.weights(version)]
        out = functional_call(self.module, dict(zip(self.versions.names, weights)), (x,))
        if ys is not None:
            loss = self.loss_fn(out, ys[j])
            losses.append(loss.detach().float())
            out = loss / self.rules.every
        else:
            self._send_activation(out, version, pending)
        saved[j] = (x, out, weights, version)
        return version, start

    def _backward(self, j: int, n: int, saved: dict, pending: list) -> tuple[int, float]:
        """Backward of microbatch ``j`` on its stashed version, then this stage's update when a window ends
        (its time counts as the backward's: the stage is busy with it)."""
        x, out, weights, version = saved.pop(j)
        grad_out = None
        if self.stage != self.n_stages - 1:
            grad_out = torch.empty_like(out)
            dist.recv(grad_out, self._peer(+1), group=self.pp_group)
        start = time.time()
        wants_x = x.requires_grad
        grads = torch.autograd.grad(out, ([x] if wants_x else []) + weights, grad_out, allow_unused=True)
        if wants_x:
            self._send(grads[0], -1, pending)
            grads = grads[1:]
        self._accumulate(grads)
        if (n + 1) % self.rules.every == 0:
            self._update()
        floor = self.rules.floor(self.versions.current, self._newest_seen)
        self.versions.release(floor, {v for *_, v in saved.values()})
        return version, start

    def _accumulate(self, grads) -> None:
        for p, g in zip(self.versions.live, grads):
            if g is None:
                continue
            p.grad = g if p.grad is None else p.grad + g

    def _update(self) -> None:
        """Average the window's gradient over dp, clip on this stage's norm, step, zero; the version moves on."""
        live = self.versions.live
        if self.dp_group is not None:  # one flat all-reduce per update, not one per tensor
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in live]
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(dist.get_world_size(self.dp_group))
            dist.all_reduce(flat, group=self.dp_group)
            for p, g in zip(live, flat.split([g.numel() for g in grads])):
                p.grad = g.view_as(p)
        self._last_sq_norm = clip_grads(live, self.grad_clip) ** 2
        self.versions.before_update()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def grad_norm(self) -> float:
        """The norm, over all stages, of each stage's last update in the step."""
        sq = torch.tensor([self._last_sq_norm], dtype=torch.float64, device=self.device)  # NCCL: on the device
        dist.all_reduce(sq, group=self.pp_group)
        return float(sq.sqrt())

    # -- checkpoint state ------------------------------------------------------------------------------

    def resume_at(self, step: int) -> None:
        """Set the version count a run that has trained ``step`` steps is at (checkpoint load, snapshots)."""
        self.versions.current = step * self.microbatches // self.rules.every
        self.versions.stash.clear()
        self._newest_seen = self.versions.current

    def state_dict(self) -> dict:
        """The version besides the live weights the next step still runs on (2BW's second buffer), by name."""
        if not self.rules.one_version_late:
            return {}
        prev = max(0, self.versions.current - 1)
        return dict(zip(self.versions.names, self.versions.weights(prev)))

    def load_state_dict(self, state: dict, step: int) -> None:
        """Take the versions ``state_dict`` gave back (a checkpoint or snapshot of step ``step``)."""
        self.resume_at(step)
        if self.rules.one_version_late and state:
            prev = max(0, self.versions.current - 1)
            self.versions.stash[prev] = [state[n].detach().to(self.device, copy=True) for n in self.versions.names]
