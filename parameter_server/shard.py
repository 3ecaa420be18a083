"""``PSShard``: one parameter-server shard, holding the chunks the ring gives it and updating them.

Plain Python; the orchestrator makes it a threaded Ray actor (calls that wait
block only their own thread). A shard holds each chunk it is primary *or*
successor for: clients send every push to both holders, and both run the same
deterministic update, so the successor can take over with nothing
acknowledged lost.

Consistency (``bsp``/``asp``/``ssp``):
- ``bsp``: pushes for clock t are staged per worker; once every worker of a key
  has pushed t, ``grad_sq`` returns the squared norm of the averaged gradient
  (for the job-wide clipping coefficient) and ``apply(t, coef)`` runs one
  optimizer step with ``coef * mean(grads)``, summed in worker order so both
  holders compute bit-identical results. ``pull(min_version=t+1)`` waits for it.
- ``asp``/``ssp``: a push is applied on arrival (its gradient weighted 1/workers,
  as one worker's share of a global batch). Each ``pull`` records the reader's
  clock and the fewest pushes this shard has applied from any worker of the
  reader's pipeline stage, so the SSP bound can be checked, per stage, from
  what the shard really held.

A pusher's id is ``stage * workers + replica`` (``stages`` pipeline stages of
``workers`` data-parallel replicas; without a pipeline, the data rank): each
stage's keys are its own, and so are its clocks.

A caller steers no more than a worker may: the learning rate comes from the
job's schedule the shard was built with (``lrs``, one per step), never from a
request; a clipping coefficient may only shrink the step, down from the bound
this shard's own share of the gradient norm sets; worker ids, clocks, keys,
shapes and finiteness are checked before anything is staged or applied; the
key set is sealed by the first push (a late ``register`` cannot add a key
every worker would have to push); and a wait ends at the caller's deadline.
"""

from __future__ import annotations

import copy
import math
import os
import signal
import threading
from pathlib import Path

import torch

from parameter_server import compression, optimizers

WAIT_S = 600.0


class PSShard:
    def __init__(self, shard_id: int, consistency: str, optim: dict, workers: int, lrs: list[float],
                 max_norm: float = 0.0, stages: int = 1):
        """``lrs[s]``: the job's learning rate at step ``s`` (the worker's schedule, computed once by the
        controller); ``max_norm``: the job's gradient clipping norm (0: off); ``workers``: data-parallel
        replicas, ``stages``: pipeline stages of each."""
        torch.set_num_threads(1)
        self.id = shard_id
        self.consistency = consistency
        self.optim = optim
        self.workers = workers
        self.stages = stages
        self.lrs = [float(lr) for lr in lrs]
        self.max_norm = max_norm
        self.cond = threading.Condition()
        self.params: dict[str, torch.Tensor] = {}
        self.opts: dict[str, torch.optim.Optimizer] = {}
        self.version = 0  # bsp: clocks applied; asp/ssp: pushes applied
        self.applied_from = [0] * (workers * stages)  # asp/ssp: pushes applied per pusher (stage, replica)
        self.staged: dict[int, dict[str, dict[int, torch.Tensor]]] = {}  # bsp: clock -> key -> worker -> grad
        self.means: dict[int, dict[str, torch.Tensor]] = {}
        self.sqs: dict[int, dict[str, float]] = {}  # kept past apply: a worker failing over may still ask
        self.reads: list[dict] = []
        self.kill_after: int | None = None  # kill_ps_shard: pushes still to acknowledge before dying
        self.grpc = None
        self.layout: dict[str, dict] = {}
        self.sealed = False  # the first push fixes the key set
        self.kept: dict[int, dict] = {}  # step -> state, for rolling back with the ranks
        self.epoch = 0  # bumped by ``restore``: a call waiting across a rollback fails instead of hanging
        self.halted = False  # from ``abort`` until the next ``restore``

    # -- setup ------------------------------------------------------------------------------

    def ping(self) -> int:
        return self.id

    def register(self, chunks: dict[str, torch.Tensor], layout: dict | None = None) -> int:
        """Initial values; the first registration of a key wins (every worker starts from the same seed).

        ``layout`` ({name: {shape, dtype}} of the whole model) is kept so an outside reader can ask for it.
        """
        with self.cond:
            for key, value in chunks.items():
                held = self.params.get(key)
                if held is None and self.sealed:
                    raise ValueError(f"shard {self.id}: register of new key {key!r} after training started; "
                                     "nothing registered (every worker registers before its first push)")
                if held is not None and (held.shape != value.shape or held.dtype != value.dtype):
                    raise ValueError(f"shard {self.id}: register of key {key!r} with shape {tuple(value.shape)} "
                                     f"dtype {value.dtype}, held as shape {tuple(held.shape)} dtype {held.dtype}; "
                                     "nothing registered")
                self._ndim(key, {**self.layout, **(layout or {})})
            self.layout.update(layout or {})
            for key, value in chunks.items():
                if key not in self.params:
                    self.params[key] = value.detach().clone()
                    self.opts[key] = self._optimizer(key)
            return len(self.params)

    def _ndim(self, key: str, layout: dict) -> int:
        """Dimensions of the tensor chunk ``key`` is cut from (``layout``), which pick its weight decay
        (``optimizers.dict_decay``). Unknown is refused only where it matters (``weight_decay_exclude: 1d`` with a
        decay): an outside client may register without a layout."""
        info = layout.get(key.rpartition("#")[0])
        if info is not None:
            return len(info["shape"])
        if optimizers.dict_decay(self.optim, 1) != optimizers.dict_decay(self.optim, 2):
            raise ValueError(f"shard {self.id}: register of key {key!r} without its tensor's layout (shape), so "
                             "whether optim.weight_decay_exclude: 1d spares it is unknown; nothing registered "
                             "(send the layout with the chunks)")
        return 2

    def _optimizer(self, key: str) -> torch.optim.Optimizer:
        """The optimizer of chunk ``key`` (registered, with its tensor's layout known)."""
        return optimizers.build(self.params[key], self.optim, self._ndim(key, self.layout))

    # -- the push / pull / clock API --------------------------------------------------------------

    def _check(self, worker: int, clock: int, grads: dict[str, torch.Tensor]) -> None:
        """Reject the whole push, before anything is staged or applied: a worker id that is not one of the
        job's, a clock this shard cannot be at (bsp: past its version), an unknown, misshapen or non-finite
        chunk."""
        if not 0 <= worker < self.workers * self.stages:
            raise ValueError(f"shard {self.id}: push from worker {worker}, but the job's workers are 0 to "
                             f"{self.workers * self.stages - 1}; nothing applied")
        if clock < 0 or (self.consistency == "bsp" and clock > self.version):
            raise ValueError(f"shard {self.id}: push for clock {clock} while at version {self.version}; "
                             "nothing applied")
        for key, grad in grads.items():
            held = self.params.get(key)
            if held is None:
                raise KeyError(f"shard {self.id}: push of unknown key {key!r} (shape {tuple(grad.shape)}); "
                               f"nothing applied. Known keys look like {sorted(self.params)[:3]}")
            if grad.shape != held.shape or grad.dtype != held.dtype:
                raise ValueError(f"shard {self.id}: push of key {key!r} has shape {tuple(grad.shape)} dtype "
                                 f"{grad.dtype}, expected shape {tuple(held.shape)} dtype {held.dtype}; "
                                 "nothing applied")
            if not bool(torch.isfinite(grad).all()):
                raise ValueError(f"shard {self.id}: push of key {key!r} holds inf or nan; nothing applied")

    def lr(self, step: int) -> float:
        """The job's learning rate at ``step`` (the schedule's last value past its end)."""
        return self.lrs[min(step, len(self.lrs) - 1)]

    def push(self, worker: int, clock: int, grads: dict[str, torch.Tensor]) -> int:
        """Stage (bsp) or apply (asp/ssp) ``worker``'s gradients for ``clock``; returns the shard version.

        asp/ssp apply at the step the pushing stage's pushes so far amount to (every worker pushes to every
        shard once per local step, so that is their count // workers), the step its own schedule is at; a push
        for a clock this shard applied from that pusher already (a retry) is acknowledged and not applied again.
        """
        with self.cond:
            if self.halted:
                raise RuntimeError(f"shard {self.id}: push for clock {clock} refused: a rank failed and the shards "
                                   "are rolled back with the ranks; nothing applied")
            grads = {k: compression.arrived(k, g, self.params[k]) if k in self.params else g
                     for k, g in grads.items()}  # bf16 or top-k on the wire: the held dtype, dense
            self._check(worker, clock, grads)
            self._maybe_die(grads)
            self.sealed = True
            if self.consistency == "bsp":
                if clock >= self.version:  # an already applied clock is a retry after failover
                    staged = self.staged.setdefault(clock, {})
                    for key, grad in grads.items():
                        staged.setdefault(key, {})[worker % self.workers] = grad  # a key is one stage's
            elif clock < self.applied_from[worker]:
                pass  # applied already: a replaced worker redoes the step its predecessor died in, this shard had it
            else:
                lr = self.lr(sum(self._stage_counts(worker)) // self.workers)
                for key, grad in grads.items():
                    optimizers.step(self.opts[key], grad / self.workers, lr)
                self.applied_from[worker] += 1
                self.version += 1
            self.cond.notify_all()
            return self.version

    def _stage_counts(self, worker: int) -> list[int]:
        """Pushes applied from each worker of ``worker``'s pipeline stage."""
        first = worker - worker % self.workers
        return self.applied_from[first:first + self.workers]

    def _complete(self, clock: int) -> bool:
        staged = self.staged.get(clock, {})
        return all(len(staged.get(key, ())) == self.workers for key in self.params)

    def _wait(self, predicate, what: str, timeout_s: float | None) -> None:
        """Wait under the lock until ``predicate``, at most ``timeout_s`` (the caller's deadline) or ``WAIT_S``;
        a ``restore`` meanwhile ends the wait with an error (what it waited for belongs to a discarded past)."""
        limit = WAIT_S if timeout_s is None else max(0.0, min(timeout_s, WAIT_S))
        epoch = self.epoch
        if not self.cond.wait_for(lambda: self.halted or self.epoch != epoch or predicate(), timeout=limit):
            raise TimeoutError(f"shard {self.id}: waited {limit:.1f}s for {what}")
        if self.halted or self.epoch != epoch:
            raise RuntimeError(f"shard {self.id}: aborted or rolled back (version {self.version}) while waiting for "
                               f"{what}")

    def _check_clock(self, clock: int, what: str) -> None:
        """bsp: a clock this shard is at or has applied (a later one would wait for pushes that cannot come)."""
        if not 0 <= clock <= self.version:
            raise ValueError(f"shard {self.id}: {what} for clock {clock} while at version {self.version}")

    def _check_keys(self, keys: list[str], what: str) -> None:
        missing = [k for k in keys if k not in self.params]
        if missing:
            raise KeyError(f"shard {self.id}: {what} of unknown keys {missing[:3]}")

    def _mean(self, clock: int) -> dict[str, torch.Tensor]:
        if clock not in self.means:
            staged = self.staged.get(clock, {})
            self.means[clock] = {
                key: torch.stack([staged[key][w] for w in range(self.workers)]).sum(0) / self.workers
                for key in self.params
            }
            self.sqs[clock] = {key: float(m.float().pow(2).sum()) for key, m in self.means[clock].items()}
        return self.means[clock]

    def grad_sq(self, clock: int, keys: list[str], timeout_s: float | None = None) -> dict[str, float]:
        """bsp: squared L2 norm of each listed key's averaged gradient for ``clock``, once all have pushed."""
        with self.cond:
            self._check_keys(keys, "grad_sq")
            if clock not in self.sqs:
                self._check_clock(clock, "grad_sq")
            self._wait(lambda: clock in self.sqs or self._complete(clock), f"every worker's push of clock {clock}",
                       timeout_s)
            if clock not in self.sqs:
                self._mean(clock)
            return {key: self.sqs[clock][key] for key in keys}

    def _check_coef_range(self, coef: float) -> None:
        """A clipping coefficient a worker could have computed: finite, in (0, 1], exactly 1 with clipping off."""
        if not (math.isfinite(coef) and 0 < coef <= 1) or (self.max_norm == 0 and coef != 1):
            raise ValueError(f"shard {self.id}: apply with coefficient {coef} (clipping norm {self.max_norm}); "
                             "a coefficient is in (0, 1], and 1 with clipping off; nothing applied")

    def _check_coef(self, clock: int, coef: float) -> None:
        """No larger than this shard's own keys allow: the job-wide norm is at least their norm."""
        own = math.sqrt(sum(self.sqs[clock].values()))
        bound = min(1.0, self.max_norm / (own + 1e-6)) if self.max_norm > 0 else 1.0
        if coef > bound * (1 + 1e-6):
            raise ValueError(f"shard {self.id}: apply with coefficient {coef} above {bound:.6g}, the most this "
                             f"shard's own gradient norm {own:.6g} allows at clipping norm {self.max_norm}; "
                             "nothing applied")

    def apply(self, clock: int, coef: float, timeout_s: float | None = None) -> int:
        """bsp: one optimizer step on every held key with ``coef * mean gradient`` (idempotent per clock), at
        the job's learning rate for ``clock``; ``coef`` 0 skips the clock (``skip``)."""
        if coef == 0:
            return self.skip(clock)
        with self.cond:
            self._check_coef_range(coef)
            self._check_clock(clock, "apply")
            self._wait(lambda: self.version > clock or self._complete(clock), f"every worker's push of clock {clock}",
                       timeout_s)
            if self.version <= clock:
                means = self._mean(clock)
                self._check_coef(clock, coef)
                for key, opt in self.opts.items():
                    grad = means[key] * coef if coef < 1.0 else means[key]
                    optimizers.step(opt, grad, self.lr(clock))
                self.version = clock + 1
                for old in [c for c in self.staged if c <= clock]:
                    self.staged.pop(old)
                    self.means.pop(old, None)
                for old in [c for c in self.sqs if c < clock]:
                    self.sqs.pop(old)
                self.cond.notify_all()
            return self.version

    def skip(self, clock: int) -> int:
        """bsp: pass ``clock`` without a step (idempotent): every worker's fp16 gradients overflowed, so none
        pushed; the version still advances so the next clock runs at the job's learning rate for the next step,
        as the workers' schedules do. Refused once a worker pushed for ``clock`` (a skip drops no pushed step)."""
        with self.cond:
            self._check_clock(clock, "skip")
            if self.version > clock:
                return self.version
            if self.staged.get(clock):
                raise ValueError(f"shard {self.id}: skip (apply with coefficient 0) of clock {clock}, for which "
                                 f"workers {sorted({w for per in self.staged[clock].values() for w in per})} pushed; "
                                 "nothing skipped (a skip is agreed by every worker, none of which pushes)")
            self.version = clock + 1
            self.cond.notify_all()
            return self.version

    def pull(self, keys: list[str], min_version: int = 0, worker: int = -1, clock: int = -1, wire_dtype: str = "",
             timeout_s: float | None = None) -> dict:
        """Current values of ``keys`` once the shard's version reaches ``min_version`` (at most one version
        ahead: the step in flight), sent as held or cast to ``wire_dtype`` (``parameter_server.compression``).

        A worker's training read (``clock >= 0``) under asp/ssp is recorded with the fewest and the most pushes
        applied from any worker of its stage: the bound it held, and whether it read a fresher push.
        """
        with self.cond:
            self._check_keys(keys, "pull")
            compression.check_wire_dtype(wire_dtype)  # before the wait
            if not -1 <= worker < self.workers * self.stages or min_version > self.version + 1:
                raise ValueError(f"shard {self.id}: pull by worker {worker} for version {min_version} while at "
                                 f"version {self.version} with workers 0 to {self.workers * self.stages - 1}")
            self._wait(lambda: self.version >= min_version, f"version {min_version}", timeout_s)
            applied = -1  # the reply says how stale the read is (the worker's Prometheus gauge), as the log does
            if worker >= 0 and clock >= 0 and self.consistency != "bsp":
                counts = self._stage_counts(worker)
                applied = min(counts)  # max: whether a faster worker's push of this clock is in (SSP allows it)
                self.reads.append({"shard": self.id, "worker": worker, "stage": worker // self.workers,
                                   "clock": clock, "min_applied": applied, "max_applied": max(counts)})
            return {"version": self.version, "min_applied": applied,
                    "chunks": {k: compression.for_wire(self.params[k], wire_dtype).clone() for k in keys}}

    def clock(self) -> dict:
        """The shard's version and, under asp/ssp, how many pushes it applied from each worker."""
        with self.cond:
            return {"shard": self.id, "version": self.version, "applied_from": list(self.applied_from),
                    "keys": len(self.params), "layout": dict(self.layout)}

    def read_log(self) -> list[dict]:
        with self.cond:
            return list(self.reads)

    # -- durability ---------------------------------------------------------------------------

    def state(self, keys: list[str] | None = None) -> dict:
        """Values and optimizer state of ``keys`` (all held keys when None), for resync and snapshots."""
        with self.cond:
            keys = list(self.params) if keys is None else [k for k in keys if k in self.params]
            return {"version": self.version, "applied_from": list(self.applied_from), "layout": dict(self.layout),
                    "params": {k: self.params[k].clone() for k in keys},
                    "opts": {k: self.opts[k].state_dict() for k in keys}}

    def load(self, state: dict) -> int:
        """Take over keys from another holder's ``state`` (a restarted shard resyncing)."""
        with self.cond:
            self.layout.update(state["layout"])
            for key, value in state["params"].items():
                self.params[key] = value.clone()
                self.opts[key] = self._optimizer(key)
                self.opts[key].load_state_dict(state["opts"][key])
            self.version = max(self.version, state["version"])
            self.applied_from = [max(a, b) for a, b in zip(self.applied_from, state["applied_from"])]
            return len(self.params)

    def restore(self, state: dict) -> int:
        """Become exactly ``state`` (every key this shard holds, version and per-worker counts): a resumed job
        or a rollback. Staged pushes of later clocks are dropped, and a call waiting on them fails at once."""
        with self.cond:
            self.params, self.opts = {}, {}
            self.load(state)
            self.version = state["version"]
            self.applied_from = list(state["applied_from"])
            self.staged, self.means, self.sqs = {}, {}, {}
            self.halted = False
            self.epoch += 1
            self.cond.notify_all()
            return self.version

    def keep(self, step: int) -> list[int]:
        """Keep this shard's state at ``step`` in memory (beside the ranks' in-memory snapshot of that step), so
        a rollback of the ranks takes the shards with them; the first kept state and the two newest stay."""
        with self.cond:
            self.kept[step] = copy.deepcopy(self.state())
            steps = sorted(self.kept)
            for old in steps[1:-2]:
                self.kept.pop(old)
            return sorted(self.kept)

    def roll_back(self, step: int) -> int:
        """Become the state kept at ``step`` (``LookupError`` naming the steps kept when there is none)."""
        with self.cond:
            if step not in self.kept:
                raise LookupError(f"shard {self.id}: no state kept at step {step} (kept: {sorted(self.kept)})")
            for later in [s for s in self.kept if s > step]:
                self.kept.pop(later)  # a future that will not happen
            return self.restore(copy.deepcopy(self.kept[step]))

    def abort(self) -> int:
        """A rank died mid-step: drop the staged pushes, end every wait at once and refuse pushes and waits
        until the rollback (``restore``), so its survivors fail their step quickly, wherever in it they are,
        instead of waiting for a push that cannot come."""
        with self.cond:
            self.staged, self.means, self.sqs = {}, {}, {}
            self.halted = True
            self.cond.notify_all()
            return self.version

    # -- elastic shards (the shard count changes between steps: ``orchestrator/runtime/ps_resize.py``) ----------

    def set_workers(self, workers: int) -> int:
        """bsp, between steps: the job now has ``workers`` data ranks (a dp resize); each clock waits for that many
        pushes from now on. The ranks come back from a checkpoint, which ``restore`` then loads."""
        with self.cond:
            self.workers = workers
            self.applied_from = [0] * workers
            self.staged, self.means, self.sqs = {}, {}, {}
            return self.workers

    def handover(self, keys: list[str]) -> dict:
        """``keys`` as held now and in every kept step, for the shard that holds them after a resize (``take``):
        the kept steps move too, so a rollback across the resize finds each chunk on its new holders."""
        with self.cond:
            kept = {step: _only(state, keys) for step, state in self.kept.items()}
            return {"now": self.state(keys), "kept": kept}

    def take(self, bundle: dict) -> int:
        """Hold what ``handover`` gave, now and in each kept step (a step this shard kept nothing of yet, as a new
        shard, starts from the giver's clocks at that step)."""
        bundle = copy.deepcopy(bundle)  # in one process (tests) the giver's optimizer tensors would be shared
        with self.cond:
            self.load(bundle["now"])
            for step, part in bundle["kept"].items():
                mine = self.kept.setdefault(step, {**part, "params": {}, "opts": {}})
                mine["params"].update(part["params"])
                mine["opts"].update(part["opts"])
            return len(self.params)

    def drop(self, keys: list[str]) -> int:
        """Stop holding ``keys``, now and in the kept steps (after a resize they belong to other shards; a key
        left here would make every BSP apply wait for pushes that now go elsewhere)."""
        with self.cond:
            for state in [{"params": self.params, "opts": self.opts}, *self.kept.values()]:
                for key in keys:
                    state["params"].pop(key, None)
                    state["opts"].pop(key, None)
            return len(self.params)

    def save(self, path: str) -> str:
        """Snapshot every held key to ``path`` (written whole, then renamed, so a reader never sees half)."""
        state = self.state()
        tmp = Path(path).with_suffix(".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, tmp)
        os.replace(tmp, path)
        return path

    def arm_kill(self, after_pushes: int = 1) -> None:
        """Fault injection (``kill_ps_shard``): SIGKILL this process on the first gradient push after
        acknowledging ``after_pushes`` more, so the shard dies mid-step with some pushes acknowledged."""
        with self.cond:
            self.kill_after = after_pushes

    def _maybe_die(self, grads: dict) -> None:
        if self.kill_after is None or not grads:
            return
        if self.kill_after == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        self.kill_after -= 1

    # -- gRPC -----------------------------------------------------------------------------

    def serve_grpc(self, token: str, tls: tuple[bytes, bytes] | None = None, host: str | None = None) -> str:
        """Start this shard's gRPC endpoint (same push/pull/clock API, callers with ``token`` only, TLS only with
        ``tls``: certificate chain and key PEM) on ``host``, by default the node's cluster address as Ray knows
        it, never every interface; returns ``ip:port``."""
        import ray

        from parameter_server.grpc_service import serve

        if self.grpc is None:
            self.grpc = serve(self, host or ray.util.get_node_ip_address(), token, tls)
        return self.grpc.address


def _only(state: dict, keys: list[str]) -> dict:
    """``state`` (a kept ``PSShard.state()``) restricted to ``keys``."""
    return {**state, "params": {k: state["params"][k] for k in keys if k in state["params"]},
            "opts": {k: state["opts"][k] for k in keys if k in state["opts"]}}
