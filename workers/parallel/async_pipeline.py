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

How a training step maps onto it: no flush at step ends. Each stage runs one endless 1F1B order over global
microbatch ids (step k's are k*m .. k*m + m - 1 for m = ``train.microbatches``); a step is a slice of it:

- step k runs, on every stage, the forwards of its own m microbatches, each followed by the backwards that
  keep at most w = pp - s - 1 microbatches in flight on stage s (1F1B's warm-up depth). So a step's last w
  backwards on stage s run in the next step, interleaved with its first forwards: the next step's forwards
  start while the previous step's backwards are still in flight, the steady state carries across the boundary
  and only the very first step warms up (and the job's last step drains: it runs every backward left).
- the last stage (w = 0) runs each microbatch's forward and backward in the step, so the step's loss is the
  mean of its own m microbatch losses, each on its own version. The LR schedule moves once per step, and an
  update runs at the LR of the step its microbatches belong to, even when its backward ran in the next one
  (windows align with steps: ``every`` divides m; a 2BW window's gradient may still span the boundary).
- no message crosses a boundary: every activation is received in the step it is sent (each stage runs all of
  the step's forwards); the one gradient whose receiver runs that backward in the next step (the last one a
  stage s > 0 computes in the step) waits in an outbox and is sent first thing in the next step. Why: the
  controller waits for every rank's step before it starts the next, so a send still waiting for its receiver
  at a step's end could wait forever, and a snapshot cannot hold a message on the wire.
- the state at a step boundary is therefore the live weights, the stashed versions, and per stage the
  microbatches in flight (their input and version), the outbox, the gradient accumulated so far and the LR of
  a step whose updates are still due. ``state_dict`` carries all of it; a restore
  re-runs each in-flight forward on its stashed version from its saved input, which is deterministic, so the
  autograd graph its backward needs is the one the uninterrupted run had (bit for bit). It is per rank (keyed
  by pp and dp coordinate): a checkpoint with microbatches in flight resumes at the layout that wrote it.

``parallel.pp_flush_per_step: true`` drains at every step end instead (the executor's first behaviour): every
step then warms up and cools down, and its boundary holds no microbatch in flight (2BW: the previous version).

The weight-stashing invariant holds across boundaries: a microbatch's backward runs on the stashed copy its
forward ran on, whichever step each ran in. Clipping uses each stage's own gradient norm: a norm over all stages
would make every update wait for the slowest stage, which is what the schedule avoids. The ``grad_norm`` reported
is the norm, over all stages, of each stage's last update run in the step (carried, an earlier stage's may be of
a window before the step's last: that one's update is still due).

Data parallelism: each update's gradient is averaged over the stage's dp group before the step (every replica
runs the same order, so the all-reduces pair up).
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from workers.model.names import unwrap
from workers.optim.build import clip_grads

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


def step_order(warm: int, base: int, microbatches: int, in_flight: list[int], drain: bool) -> list[tuple[str, int]]:
    """A stage's slice of the endless 1F1B order for the step whose microbatches start at global id ``base``:
    each forward, then the backwards (oldest first, ``in_flight`` from earlier steps included) that leave
    ``warm`` = pp - s - 1 in flight; with ``drain``, every backward left after the last forward. Concatenated
    over steps (the last drained) this is the non-interleaved 1F1B order of the whole run on one stage."""
    queue, order = list(in_flight), []
    for n in range(base, base + microbatches):
        order.append(("F", n))
        queue.append(n)
        keep = 0 if drain and n == base + microbatches - 1 else warm
        while len(queue) > keep:
            order.append(("B", queue.pop(0)))
    return order


@dataclass
class InFlight:
    """A microbatch whose forward ran on this stage and whose backward has not: what the backward needs."""

    x: torch.Tensor  # its input: tokens on the first stage, the received activation elsewhere
    version: int
    weights: list[torch.Tensor] | None = None  # the stashed tensors its forward differentiated (None: re-run it)
    out: torch.Tensor | None = None  # its output (the scaled loss on the last stage), with the autograd graph


class AsyncPipeline:
    """One pp rank's stage under an asynchronous schedule: runs each step's slice of the 1F1B order and its
    updates, and keeps what is in flight between steps (see the module docstring).

    ``events`` (F and B per microbatch, by global id, each with the ``version`` it ran on) feed the timeline and
    the bubble, as ``TimedStage.events`` do for torch's schedules.
    """

    def __init__(self, module: nn.Module, stage: int, n_stages: int, microbatches: int, rules: AsyncRules,
                 optimizer, loss_fn, pp_group, dp_group, grad_clip: float, device: torch.device):
        self.module, self.stage, self.n_stages, self.rules = unwrap(module), stage, n_stages, rules
        self.microbatches = microbatches
        self.optimizer, self.loss_fn, self.grad_clip, self.device = optimizer, loss_fn, grad_clip, device
        self.pp_group, self.dp_group = pp_group, dp_group
        self.versions = WeightVersions(module, keep_previous=rules.follow_first_stage)
        self.events: list[dict] = []
        self.warm = n_stages - stage - 1  # microbatches 1F1B keeps in flight here after each forward
        self.in_flight: dict[int, InFlight] = {}  # global microbatch id -> its state, oldest first
        self.outbox: list[torch.Tensor] = []  # a gradient for the previous stage, sent at the next step's start
        self.step_lrs: dict[int, list[float]] = {}  # step -> its LR per param group, while its updates are due
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
        return x, version

    # -- one step ------------------------------------------------------------------------------------

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, step: int, drain: bool = False) -> torch.Tensor | None:
        """Run step ``step``'s slice of the 1F1B order (``step_order``): its m forwards, each followed by the
        backwards (of this step's or the previous one's microbatches) that keep ``warm`` in flight, and with
        ``drain`` every backward left. Returns the mean of the step's losses on the last stage, else None. The
        updates happen inside."""
        first, last, m = self.stage == 0, self.stage == self.n_stages - 1, self.microbatches
        xs = inputs.chunk(m) if first else None
        ys = targets.chunk(m) if last else None
        base, pending, losses = step * m, [], []
        self.step_lrs[step] = [group["lr"] for group in self.optimizer.param_groups]  # the scheduler's, this step
        # the previous stage runs this step's backwards while more than its warm (ours + 1) are in flight there
        hold_from = None if drain else base + m - self.warm - 1
        for grad in self.outbox:
            self._send(grad, -1, pending)
        self.outbox = []
        self._rerun_restored()
        for kind, n in step_order(self.warm, base, m, list(self.in_flight), drain):
            if kind == "F":
                j = n - base
                self._timed("F", n, self._forward, n, xs[j] if first else None, ys[j] if last else None, losses,
                            pending)
            else:
                self._timed("B", n, self._backward, n, pending, hold_from is not None and n >= hold_from)
        for work, _ in pending:  # every send of the step is received within it (the outbox waits for the next)
            work.wait()
        if drain:  # nothing in flight: keep only what the next forward may run on
            current = self.versions.current
            self.versions.release(self.rules.floor(current, current), set())
        due = {n // m for n in self.in_flight}
        self.step_lrs = {s: lrs for s, lrs in self.step_lrs.items() if s in due}
        return torch.stack(losses).sum() / m if last else None

    def _timed(self, kind: str, n: int, op, *args) -> None:
        """Run a forward or backward and record it; ``op`` returns its version and when its compute started
        (after its input arrived: waiting on a neighbour is bubble, not work)."""
        version, start = op(*args)
        self.events.append({"stage": self.stage, "microbatch": n, "kind": kind, "version": version,
                            "start": start, "end": time.time(), **self.versions.held()})

    def _forward(self, n: int, x, y, losses: list, pending: list) -> tuple[int, float]:
        """Forward of global microbatch ``n`` on the version the rules give it; keeps it in flight."""
        if x is not None:
            version = self.rules.first_stage_version(n, self.versions.current)
        else:
            x, version = self._recv_activation()
            if not self.rules.follow_first_stage:
                version = self.versions.current
        self._newest_seen = version
        start = time.time()
        job = self.in_flight[n] = InFlight(x, version)
        self._run_forward(job)
        if y is not None:
            loss = self.loss_fn(job.out, y)
            losses.append(loss.detach().float())
            job.out = loss / self.rules.every
        else:
            self._send_activation(job.out, version, pending)
        return version, start

    def _run_forward(self, job: InFlight) -> None:
        """The stage's forward of ``job.x`` on its stashed version, keeping the graph for its backward."""
        job.weights = [w.detach().requires_grad_() for w in self.versions.weights(job.version)]
        if self.stage > 0:
            job.x.requires_grad_()
        job.out = functional_call(self.module, dict(zip(self.versions.names, job.weights)), (job.x,))

    def _rerun_restored(self) -> None:
        """In-flight microbatches a restore brought back have no graph yet: re-run their forwards (deterministic:
        same input, same stashed version) before the step's first backward needs them."""
        for job in self.in_flight.values():
            if job.out is None:
                if self.stage == self.n_stages - 1:
                    raise RuntimeError("the last stage never holds a microbatch in flight at a step boundary")
                self._run_forward(job)

    def _backward(self, n: int, pending: list, hold: bool) -> tuple[int, float]:
        """Backward of microbatch ``n`` on its stashed version, then this stage's update when a window ends
        (its time counts as the backward's: the stage is busy with it). With ``hold`` the input gradient waits
        in the outbox: the previous stage runs that backward in the next step."""
        job = self.in_flight.pop(n)
        grad_out = None
        if self.stage != self.n_stages - 1:
            grad_out = torch.empty_like(job.out)
            dist.recv(grad_out, self._peer(+1), group=self.pp_group)
        start = time.time()
        wants_x = job.x.requires_grad
        grads = torch.autograd.grad(job.out, ([job.x] if wants_x else []) + job.weights, grad_out, allow_unused=True)
        if wants_x:
            if hold:
                self.outbox.append(grads[0])
            else:
                self._send(grads[0], -1, pending)
            grads = grads[1:]
        self._accumulate(grads)
        if (n + 1) % self.rules.every == 0:
            self._update(n // self.microbatches)
        floor = self.rules.floor(self.versions.current, self._newest_seen)
        self.versions.release(floor, {j.version for j in self.in_flight.values()})
        return job.version, start

    def _accumulate(self, grads) -> None:
        for p, g in zip(self.versions.live, grads):
            if g is None:
                continue
            p.grad = g if p.grad is None else p.grad + g

    def _update(self, step: int) -> None:
        """Average the window's gradient over dp, clip on this stage's norm, step at the LR of ``step`` (the
        step its microbatches belong to, though a carried backward runs in the next one), zero; the version
        moves on."""
        live = self.versions.live
        if self.dp_group is not None:  # one flat all-reduce per update, not one per tensor
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in live]
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(dist.get_world_size(self.dp_group))
            dist.all_reduce(flat, group=self.dp_group)
            for p, g in zip(live, flat.split([g.numel() for g in grads])):
                p.grad = g.view_as(p)
        self._last_sq_norm = clip_grads(live, self.grad_clip) ** 2
        self.versions.before_update()
        groups = self.optimizer.param_groups
        now = [group["lr"] for group in groups]
        for group, lr in zip(groups, self.step_lrs[step]):
            group["lr"] = lr
        self.optimizer.step()
        for group, lr in zip(groups, now):
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)

    def grad_norm(self) -> float:
        """The norm, over all stages, of each stage's last update in the step."""
        sq = torch.tensor([self._last_sq_norm], dtype=torch.float64, device=self.device)  # NCCL: on the device
        dist.all_reduce(sq, group=self.pp_group)
        return float(sq.sqrt())

    # -- checkpoint state ------------------------------------------------------------------------------

    @property
    def key(self) -> str:
        """This rank's entry in ``state_dict``: its stage and dp replica (each holds its own microbatches)."""
        dp_rank = dist.get_rank(self.dp_group) if self.dp_group is not None else 0
        return f"pp{self.stage}_dp{dp_rank}"

    def resume_at(self, step: int) -> None:
        """A drained state at ``step`` (nothing in flight, no stash, no gradient): the version count after its
        updates."""
        self.versions.current = step * self.microbatches // self.rules.every
        self.versions.stash.clear()
        self.in_flight.clear()
        self.outbox, self.step_lrs = [], {}
        self._newest_seen = self.versions.current
        for p in self.versions.live:
            p.grad = None

    def state_dict(self) -> dict[str, bytes]:
        """What a step boundary holds besides the live weights: the version count, the stashed versions, each
        in-flight microbatch's input and version, the outbox, the LRs of steps with updates still due and the
        gradient accumulated so far (a 2BW window may span the boundary). Serialized to bytes under ``key``: DCP then
        stores it whole per rank (its entries vary by stage and step, so a load could not name them up front),
        and a snapshot pickles it as it is."""
        cpu = lambda t: t.detach().to("cpu", copy=True)  # noqa: E731
        state = {"layout": [self.stage, self.n_stages, self.microbatches, self.rules.every],
                 "current": self.versions.current, "newest_seen": self._newest_seen,
                 "stash": {v: [cpu(t) for t in ts] for v, ts in self.versions.stash.items()},
                 "in_flight": [(n, job.version, cpu(job.x)) for n, job in self.in_flight.items()],
                 "outbox": [cpu(g) for g in self.outbox], "step_lrs": self.step_lrs,
                 "grads": [None if p.grad is None else cpu(p.grad) for p in self.versions.live]}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return {self.key: buffer.getvalue()}

    def load_state_dict(self, state: dict, step: int) -> None:
        """Take back what ``state_dict`` gave (a checkpoint or snapshot of step ``step``); the in-flight forwards
        re-run at the next step's start. Without any entry: a drained state at ``step``. A state saved at another
        layout (a checkpoint resumed elsewhere, an elastic resize) is refused: its microbatches in flight belong to
        the data split and stages that wrote it."""
        self.resume_at(step)
        if not state:
            return
        layout = [self.stage, self.n_stages, self.microbatches, self.rules.every]
        saved = torch.load(io.BytesIO(state[self.key]), weights_only=True) if self.key in state else None
        if saved is None or saved["layout"] != layout:
            raise ValueError(f"the asynchronous pipeline state for {self.key} (stage, stages, microbatches, "
                             f"microbatches per update: {layout}) is not in this checkpoint or snapshot (it holds "
                             f"{sorted(state)}{'' if saved is None else ', saved as ' + str(saved['layout'])}): "
                             "its in-flight microbatches resume only at the layout that saved them (pp, dp, "
                             "train.microbatches); changing the layout of an asynchronous pipeline is not supported")
        to_device = lambda t: t.to(self.device, copy=True)  # noqa: E731
        self.versions.current, self._newest_seen = saved["current"], saved["newest_seen"]
        self.versions.stash = {v: [to_device(t) for t in ts] for v, ts in saved["stash"].items()}
        self.in_flight = {n: InFlight(to_device(x), version) for n, version, x in saved["in_flight"]}
        self.outbox = [to_device(g) for g in saved["outbox"]]
        self.step_lrs = saved["step_lrs"]
        for p, grad in zip(self.versions.live, saved["grads"]):  # a 2BW window's gradient so far
            p.grad = None if grad is None else to_device(grad)
