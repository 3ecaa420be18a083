"""The trainer's side of ``parallel.dp_sync: ps``: gradients go to parameter-server shards, not an all-reduce.

``bsp`` (one call per step, after backward): push this data rank's gradients,
get the job-wide norm of the *averaged* gradient from the shards (summed over
pipeline stages) to clip exactly as the all-reduce path does, have the shards
step, and pull the new parameters; this reproduces all-reduce data
parallelism. ``asp``/``ssp``: the worker trains on its own thread (pull,
compute, clip its own gradient, push, tick its clock) while the clock keeper
has steps left, so a fast worker runs ahead of a straggler (ssp: by at most
``staleness`` clocks); each controller step reports what it did meanwhile.

A worker is one pipeline stage of one data-parallel replica (id ``stage * dp +
replica``, the same on the shards and the clock keeper): each stage's keys are
on their own clocks. The stages of a replica run each step together (the
schedule's p2p pairs them; their clip norm and fp16 overflow vote are summed
over the replica's pipeline group, never across replicas), and the keeper hands
a replica's step to all its stages at once, so only replicas drift. Under fp16
an overflowed step is the replica's alone: it pushes nothing (an empty push
passes its clock on every shard), its scaler backs off, and no other worker
waits for it: there is no global step to skip.

A rank lost under asp/ssp is not rolled back: the keeper hands its unfinished
step back (``ClockKeeper.hand_over``), the group is re-formed, and every
worker ``rejoin``s at the clock the keeper holds for it, pulling the current
parameters from the shards at its next local step.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from parameter_server.client import PSClient, RayConn
from parameter_server.ring import split
from workers.diagnostics.faults import NO_FAULT, StepFault
from workers.parallel.grad_compression import WireCodec
from workers.protocol import StepTimes
from workers.spec import WorkerSpec
from workers.state.train_state import TrainState

CARRY_WAIT_S = 30.0  # how long a re-formed survivor waits for its free-running step to end (feedback_to_carry)
ROUND_POLL_S = 1.0  # how often a round's wait looks at the free-running loop's error
GIVE_UP_S = 30.0  # how long a worker whose step failed waits for the clock keeper to take the step back


def _conn(route: dict, transport: str):
    if transport == "grpc":
        from parameter_server.grpc_service import GrpcConn

        return GrpcConn(route["address"], route["token"], route.get("root_cert"))
    return RayConn(route["handle"])


def _tp_sharded(param) -> bool:
    return isinstance(param, DTensor) and any(not pl.is_replicate() for pl in param.placements)


def _key(name: str, param, tp_rank: int) -> str:
    """A tensor-parallel slice is a key of its own (``name@tp1``): each TP rank pushes and pulls only its slice;
    a replicated parameter keeps one key that every TP rank of a data rank pushes (the same gradient)."""
    return f"{name}@tp{tp_rank}" if _tp_sharded(param) else name


def _local(param) -> torch.Tensor:
    """This rank's part of a parameter (a DTensor's local tensor: writing it writes the parameter)."""
    return param.to_local() if isinstance(param, DTensor) else param


def _local_grad(param) -> torch.Tensor:
    """This rank's gradient, laid out like its part of the parameter (a partial one is summed over TP now)."""
    grad = param.grad
    if isinstance(grad, DTensor):
        return grad.redistribute(grad.device_mesh, param.placements).to_local()
    return grad


class PSSync:
    """The client side of one worker (this stage of this data-parallel replica): its keys, the bsp push/pull,
    the asp/ssp free-running loop and its rounds, and top-k's error feedback. It reads and advances the rank's
    ``TrainState`` (cursor, step, schedulers) and nothing else of the rank's; an asp/ssp local step is the
    engine's (``workers.step.ps_round.PSRound``), handed to ``run_round``."""

    def __init__(self, spec: WorkerSpec, state: TrainState, parts, coords, mesh, device: torch.device):
        ps, routes, grid = spec.parameter_server, spec.ps_routes, spec.parallel.grid
        self.state, self.device, self.dp = state, device, spec.parallel.dp
        self.transport = ps.transport
        self.asynchronous = ps.consistency != "bsp"
        self.max_norm = spec.optim.grad_clip
        self.worker = coords.pp * self.dp + coords.dp  # this stage of this replica
        self.codec = WireCodec(ps.compression, ps.topk_ratio)
        self.client = PSClient([_conn(r, self.transport) for r in routes["shards"]], ps.chunk_elems,
                               ps.virtual_nodes, worker=self.worker, codec=self.codec)
        self.keeper = routes.get("keeper")
        self.tp_group = mesh["tp"].get_group() if grid.tp_enabled else None
        self.pp_group = mesh["pp"].get_group() if grid.pp_enabled else None
        stages = zip(parts.stage_ids, parts.modules)
        self.named = {_key(f"stage{sid}.{n}", p, coords.tp): p for sid, m in stages
                      for n, p in m.named_parameters()}
        self.tp_keys = [n for n, p in self.named.items() if _tp_sharded(p)]
        self.whole_keys = [n for n in self.named if n not in self.tp_keys]
        self.client.register({n: _local(p).detach() for n, p in self.named.items()})
        self.clock = 0
        self.thread: threading.Thread | None = None  # asp/ssp: this worker's free-running steps
        self.lock = threading.Lock()
        self.done: list[dict] = []  # the free-running steps not reported yet, each with its clock
        self.fault = NO_FAULT  # the latest controller step's injected fault (slow_rank slows every local step)
        self.error: BaseException | None = None
        self.last_loss: float | None = None
        self.quiet = threading.Lock()  # held through each free-running step; a checkpoint save takes it
        self.generation = 0  # the keeper's, this worker's loop runs under (``ClockKeeper.hand_over`` ends it)
        state.wire_feedback = self  # top-k's held-back gradient travels with snapshots and checkpoints

    def reroute(self, shard: int, route: dict) -> None:
        self.client.reroute(shard, _conn(route, self.transport))

    def reshard(self, routes: list[dict]) -> None:
        """The shard count changed between steps: one route per shard of the new ring."""
        self.client.reshard([_conn(r, self.transport) for r in routes])

    def resume_at(self, step: int) -> int:
        """The shards were restored (a checkpoint, a rollback): bsp continues at clock ``step``, asp/ssp
        ``rejoin``; returns the clock. Top-k's error feedback came back with the snapshot or checkpoint."""
        if self.asynchronous:
            return self.rejoin(step)
        self.clock = step
        return self.clock

    def rejoin(self, step: int) -> int:
        """asp/ssp: continue at controller step ``step`` and at the clock the keeper holds for this worker (a
        replacement at its predecessor's, whose unfinished step went back to the budget), reading the data
        where that many local steps end (each reads one global batch's share: the cursor and the clock stay
        one fact, whatever a checkpoint or a lost step left in the cursor). Returns the clock."""
        import ray

        kept = ray.get(self.keeper.state.remote())
        self.clock, self.generation = kept["clocks"][self.worker], kept["generation"]
        self.last_loss = kept["losses"][self.worker]  # reported until this worker completes a step again
        state = self.state
        state.cursor.load_state_dict({**state.cursor.state_dict(), "position": self.clock * state.cursor.global_batch})
        if state.step > step:
            raise RuntimeError(f"worker {self.worker} is at step {state.step}, past the controller's {step}")
        while state.step < step:  # a rebuilt trainer starts at step 0: its schedule catches up
            state.step += 1
            for sched in state.schedulers:
                sched.step()
        return self.clock

    def feedback_to_carry(self) -> dict | None:
        """asp/ssp: this worker's top-k error feedback for the trainer a survivor rebuilds when the group is
        re-formed. Nothing rolls back there, so the gradient it held back must outlive the trainer (bsp rolls
        back to a snapshot, which holds its feedback). Taken between free-running steps; a step that never ends
        (``CARRY_WAIT_S``) leaves the rebuilt trainer at zero feedback rather than the group waiting forever."""
        if not self.asynchronous or not self.codec.errors or not self.quiet.acquire(timeout=CARRY_WAIT_S):
            return None
        try:
            return {"worker": self.worker, "dp": self.dp, "errors": self.state_dict()}
        finally:
            self.quiet.release()

    def carry_over(self, carried: dict | None) -> None:
        """Continue with the feedback ``feedback_to_carry`` took from this rank's previous trainer, when it was
        the same worker of the same data-parallel degree (a changed grid starts at zero, as a resume does)."""
        if carried and (carried["worker"], carried["dp"]) == (self.worker, self.dp):
            self.load_state_dict(carried["errors"])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Top-k's error feedback per chunk key (what this worker held back from its pushes so far)."""
        return {k: e.detach().to("cpu", copy=True) for k, e in self.codec.errors.items()}

    def load_state_dict(self, errors: dict[str, torch.Tensor]) -> None:
        """Take error feedback held as CPU copies (a snapshot, a checkpoint, a survivor's previous trainer) onto
        this rank's device, where the gradient chunks it is added to live."""
        self.codec.errors = {k: e.to(self.device, copy=True) for k, e in errors.items()}

    def _dcp_prefix(self) -> str:
        """Each worker's error feedback is its own, per chunk: DCP keys name the data-parallel degree, the chunk
        size and the worker, so a checkpoint resumed at another dp or ``chunk_elems`` finds none of them (and
        starts top-k's feedback at zero) rather than chunks of the same name and another size, which DCP refuses."""
        return f"dp{self.dp}.c{self.client.chunk_elems}.w{self.worker}/"

    def dcp_state(self, template: bool = False) -> dict[str, torch.Tensor]:
        """The error feedback keyed for a DCP checkpoint; ``template``: every chunk key this worker pushes,
        filled with NaN (a residual is always finite, so a NaN left after a partial load marks a key the
        checkpoint did not hold)."""
        if not template:
            return {self._dcp_prefix() + k: e for k, e in self.state_dict().items()}
        chunks = {k: c for n, p in self.named.items()
                  for k, c in split(n, _local(p).detach(), self.client.chunk_elems).items()}
        return {self._dcp_prefix() + k: torch.full_like(c, float("nan"), device="cpu") for k, c in chunks.items()}

    def load_dcp_state(self, loaded: dict[str, torch.Tensor], checkpoint: str = "",
                       saved_decay: dict[str, float] | None = None) -> bool:
        """Take ``dcp_state(template=True)`` after DCP filled it: all keys found, or none taken (zero feedback,
        as a run that never pushed has). Returns whether it was taken. ``checkpoint`` and ``saved_decay``
        (``CompressionFeedback``'s, for keys an older save wrote otherwise) are not needed: chunk keys are names."""
        found = all(bool(torch.isfinite(t).all()) for t in loaded.values()) and bool(loaded)
        prefix = self._dcp_prefix()
        self.load_state_dict({k.removeprefix(prefix): t for k, t in loaded.items()} if found else {})
        return found

    def _grads(self) -> dict[str, torch.Tensor]:
        """Every key, every step (a parameter without a gradient pushes zeros, so BSP never waits on it)."""
        return {n: _local_grad(p) if p.grad is not None else torch.zeros_like(_local(p))
                for n, p in self.named.items()}

    def pull(self, min_version: int = 0, clock: int | None = None) -> None:
        """Copy the shards' values into the model; ``clock`` -1 marks a read outside training (not recorded)."""
        fresh = self.client.pull(list(self.named), min_version, clock=self.clock if clock is None else clock)
        with torch.no_grad():
            for n, p in self.named.items():
                _local(p).copy_(fresh[n])

    def sync(self) -> float:
        """bsp: push, clip on the global norm of the averaged gradient, apply, pull; returns that norm (the
        shards step at the job's learning rate for this clock, the one this rank's scheduler reports)."""
        t = self.clock
        self.client.push(t, self._grads())
        sq = torch.tensor(self.client.grad_sq(t, self.tp_keys), dtype=torch.float64)
        if self.tp_group is not None:  # each tensor-parallel rank's own slices; the replicated rest once
            dist.all_reduce(sq, group=self.tp_group)
        sq += self.client.grad_sq(t, self.whole_keys)
        if self.pp_group is not None:
            dist.all_reduce(sq, group=self.pp_group)
        norm = math.sqrt(float(sq))
        coef = self.max_norm / (norm + 1e-6)
        self.client.apply(t, coef if self.max_norm > 0 and coef < 1.0 else 1.0)
        self.clock += 1
        self.pull(min_version=self.clock)
        return norm

    def skip(self) -> float:
        """bsp, fp16: every rank found an overflow (the loss scaler agrees job-wide), so no worker pushes; the
        shards pass this clock without a step, keeping clock and step (and so the learning rate) together."""
        self.client.skip(self.clock)
        self.clock += 1
        return float("nan")

    def run_round(self, fault: StepFault, local_step: Callable[[], dict]) -> dict:
        """asp/ssp: this worker trains on its own thread from the first call on (each ``local_step()`` one step,
        returning its record: loss, grad_norm, tokens, applied, clock); a controller step returns once
        ``step * dp`` worker steps have completed, with what this worker did meanwhile: the round's loss, norm,
        learning rate, tokens, whether any step applied, its local steps, the clock and its ``StepTimes``."""
        fault.before()
        self.fault = fault
        if self.thread is None:
            self.thread = threading.Thread(target=self._run_free, args=(local_step,), name="ps-async-steps",
                                           daemon=True)
            self.thread.start()
        t0 = time.perf_counter()
        state = self.state
        mine = self._wait_round(self.keeper.wait_completed.remote((state.step + 1) * self.dp, self.worker,
                                                                  self.generation))
        with self.lock:  # this replica's steps among the first (step + 1) * dp completed: the same for its stages
            done = [d for d in self.done if d["clock"] < mine]
            self.done = [d for d in self.done if d["clock"] >= mine]
        losses = [d["loss"] for d in done if d["loss"] is not None]  # None off the last stage
        if losses:  # a worker that ran ahead may have nothing new: it repeats its latest loss
            self.last_loss = statistics.fmean(losses)
        lr = state.schedulers[0].get_last_lr()[0]
        state.step += 1
        for sched in state.schedulers:
            sched.step()
        total = time.perf_counter() - t0
        busy = sum(d["seconds"] for d in done)
        norms = [d["grad_norm"] for d in done if math.isfinite(d["grad_norm"])]  # an fp16 overflow has none
        return {"loss": self.last_loss, "grad_norm": statistics.fmean(norms) if norms else float("nan"), "lr": lr,
                "tokens": sum(d["tokens"] for d in done), "applied": any(d["applied"] for d in done),
                "local_steps": len(done), "clock": self.clock,
                "time_s": StepTimes(compute=busy, communication=max(0.0, total - busy), step=total)}

    def _wait_round(self, ref) -> int:
        """``ref``'s answer (the keeper's ``wait_completed``), or this worker's own loop's error as soon as it
        has one: a push no shard took, or a bug, would otherwise surface only after the heartbeat timeout
        declared the rank hung, because a round whose replica cannot step may never end."""
        import ray

        while self.error is None and not ray.wait([ref], timeout=ROUND_POLL_S)[0]:
            pass  # the round has not ended and the loop has not failed: look again
        if self.error is not None:
            raise self.error
        return ray.get(ref)

    def _run_free(self, local_step: Callable[[], dict]) -> None:
        """Take a step from the keeper, run it (``local_step``), tick, while the keeper hands out steps."""
        import ray

        try:
            while ray.get(self.keeper.enter.remote(self.worker, self.generation)):
                s0 = time.perf_counter()
                with self.quiet:
                    record = local_step()
                seconds = time.perf_counter() - s0
                record["seconds"] = seconds + self.fault.slow_down(seconds)  # a slower device: its step takes longer
                with self.lock:  # recorded before the tick, so a step that ends a controller step is in it
                    self.done.append(record)
                ray.get(self.keeper.tick.remote(self.worker, record["loss"], self.generation))
            self.pull(clock=-1)  # leave the newest weights in the model for checkpoints
        except BaseException as exc:  # handed to the controller by the next run_round
            self.error = exc
            self._give_up()

    def _give_up(self) -> None:
        """Tell the keeper this worker's step will not be ticked, so a hand-over does not wait for it; best
        effort (the keeper may be what failed)."""
        import ray

        with contextlib.suppress(Exception):  # the step's own error is what the controller must see
            ray.get(self.keeper.give_up.remote(self.worker), timeout=GIVE_UP_S)

    def push_local(self, finite: bool) -> int:
        """asp/ssp: push this worker's clipped gradient (after an fp16 overflow in any of the replica's stages,
        nothing but the clock: the scaler has backed off) and move the clock on; returns the clock pushed at."""
        clock = self.clock
        self.client.push(clock, self._grads() if finite else {})
        self.clock += 1
        return clock
