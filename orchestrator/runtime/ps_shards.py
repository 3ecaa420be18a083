"""The controller's side of the parameter server: start the shards, keep them alive, snapshot them.

Shards are threaded Ray actors (``PSShard``) spread over the cluster; each also
serves gRPC on its node's cluster address so processes outside Ray can read
weights (``ps_routes.json`` in the run directory says where, where the job's
token is, and, with ``parameter_server.tls_cert``, that the wire is TLS and
which certificate to trust). Between steps, ``after_step`` pings every
shard (``ping_shards``); a dead one is restarted and resynced from the live holders of its keys
(the successor holds its primary keys, the primaries hold its replicas), then
every worker is told to use it again. ``kill_ps_shard`` faults are armed here.
"""

from __future__ import annotations

import json
import pickle
import time
from contextlib import contextmanager
from pathlib import Path

import ray
import torch

from orchestrator.api.auth import job_token
from orchestrator.events import event
from orchestrator.runtime import ps_resize
from orchestrator.spec import JobSpec
from parameter_server import checkpoint
from parameter_server.client import UNAVAILABLE_RETRY_S
from parameter_server.clocks import ClockKeeper
from parameter_server.errors import CertificateRefused
from parameter_server.grpc_service import check_handshake
from parameter_server.reader import write_routes
from parameter_server.ring import HashRing, layout_keys
from parameter_server.shard import PSShard
from parameter_server.tls import read_pair
from workers.optim.build import lr_lambda

PING_S = 30.0


def answer(refs, what: str, timeout_s: float):
    """``ray.get`` with a deadline: a shard (or the clock keeper) that does not answer in time fails the job
    saying what was waited for, instead of hanging it (the controller's other calls have deadlines too)."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"parameter server: {what} did not answer within {timeout_s:.0f} s (5 x fault_tolerance."
            "heartbeat_timeout_s); fix: look at the shard's log (`ray logs actor`), or raise heartbeat_timeout_s "
            "if the shards are large") from None


class PSShards:
    def __init__(self, spec: JobSpec, run_dir):
        self.spec = spec
        self.ps = spec.parameter_server
        self.run_dir = run_dir
        self.ring = HashRing(self.ps.shards, self.ps.virtual_nodes)
        self.token = job_token(run_dir)  # the control API's: one secret (or Ray's token) per job
        self.tls = read_pair("parameter_server", self.ps.tls_cert, self.ps.tls_key)  # read here: shards need no copy
        self.deadline_s = 5 * spec.fault_tolerance.heartbeat_timeout_s  # what any call on a shard may take
        self.handles = [self._new_shard(i) for i in range(self.ps.shards)]
        self.addresses = answer([self._serve(i) for i in range(len(self.handles))],
                                "starting the shards' gRPC servers", self.deadline_s)
        try:
            self._check_certificate(range(len(self.handles)))
        except CertificateRefused:
            for h in self.handles:  # the controller has no PSShards to stop yet
                ray.kill(h)
            raise
        self.keeper = None
        if self.ps.consistency != "bsp":
            staleness = self.ps.staleness if self.ps.consistency == "ssp" else None
            self.keeper = ray.remote(max_concurrency=64)(ClockKeeper).options(num_cpus=0).remote(
                spec.parallel.dp, staleness, spec.train.steps, spec.parallel.pp)
        self.recoveries: list[dict] = []
        self.resizes: list[dict] = []  # parameter_server.resize: one record per change of the shard count
        self.removed_reads: list[dict] = []  # the read logs of shards a resize removed
        self._armed: dict[int, tuple[int, float]] = {}  # shard -> (step, time) of its kill_ps_shard
        self._write_routes()
        event("ps_shards", shards=self.ps.shards, consistency=self.ps.consistency, transport=self.ps.transport,
              grpc=",".join(self.addresses))

    def set_workers(self, spec: JobSpec) -> None:
        """bsp: the grid was relaunched at another dp (``raymesh scale``); the shards count its data ranks."""
        self.spec = spec
        self.answer([h.set_workers.remote(spec.parallel.dp) for h in self.handles], "the shards (new data ranks)")

    def answer(self, refs, what: str):
        """``answer`` at this job's deadline for shard calls."""
        return answer(refs, what, self.deadline_s)

    def add_shard(self, shard: int) -> None:
        """Start shard ``shard`` (empty, serving gRPC) at the end of the list (a resize fills it)."""
        self.handles.append(self._new_shard(shard))
        self.addresses.append(self.answer(self._serve(shard), f"new shard {shard} (its gRPC server)"))
        self._check_certificate([shard])

    def remove_shard(self, shard: int) -> None:
        """Stop the last shard (a resize moved its chunks away first), keeping the reads it recorded for
        ``write_read_log``, and delete its disk snapshot, which holds keys of a ring that is gone."""
        self.removed_reads += self.answer(self.handles[shard].read_log.remote(), f"shard {shard} (its read log)")
        ray.kill(self.handles.pop(shard))
        self.addresses.pop(shard)
        (self.run_dir / "ps" / f"shard-{shard}.pt").unlink(missing_ok=True)

    def _serve(self, shard: int):
        """Start shard ``shard``'s gRPC server with the job's token and TLS (the ref of its address)."""
        return self.handles[shard].serve_grpc.remote(self.token.value, self.tls, self._grpc_host())

    def _grpc_host(self) -> str | None:
        """Where the shards' gRPC listens: loopback when only an outside reader on this machine can use it (the
        ranks reach the shards through Ray, and the cluster is this one node), else the shard's node address
        (None), which ranks and readers on other nodes must reach."""
        one_node = sum(node["Alive"] for node in ray.nodes()) == 1
        return "127.0.0.1" if self.ps.transport == "ray" and one_node else None

    def _check_certificate(self, shards) -> None:
        """With TLS, dial each of ``shards`` trusting the job's certificate, as the ranks will: one that does not
        name a shard's node address (a shard started, or restarted, on a node the certificate forgot) fails the
        job here naming parameter_server.tls_cert, the address and the fix, instead of every rank finding every
        shard refusing it."""
        for shard in shards if self.tls is not None else ():
            check_handshake(self.addresses[shard], self.token.value, self.tls[0])

    def _new_shard(self, shard: int):
        optim = self.ps.server_optim(self.spec.optim)
        # no runtime_env of its own: Ray gives an actor of num_cpus=0 one OpenMP thread (and the shard sets torch's),
        # and an actor with one takes a fresh process through Ray's runtime-env setup (~1 s more to start)
        return ray.remote(max_concurrency=64)(PSShard).options(num_cpus=0).remote(
            shard, self.ps.consistency, optim, self.spec.parallel.dp, self._learning_rates(),
            self.spec.optim.grad_clip, self.spec.parallel.pp)

    def _learning_rates(self) -> list[float]:
        """The job's learning rate at every step, as each rank's ``LambdaLR`` computes it (base × factor), so
        a shard steps at the rate the workers' schedule says and no request can set another."""
        optim, steps = self.spec.optim, self.spec.train.steps
        factor = lr_lambda(optim, steps)
        return [optim.lr * factor(step) for step in range(steps)]

    def _write_routes(self) -> None:
        """Where an outside reader finds the shards (``parameter_server.reader``)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        routes = {"addresses": self.addresses, "vnodes": self.ps.virtual_nodes, "chunk_elems": self.ps.chunk_elems,
                  "token": self.token.source}
        if self.tls is not None:  # the wire is TLS: the reader trusts this file (or RAYMESH_TLS_CA)
            routes["tls_cert"] = self.ps.tls_cert
        write_routes(self.run_dir, routes)

    def route(self, shard: int) -> dict:
        return {"handle": self.handles[shard], "address": self.addresses[shard], "token": self.token.value,
                "root_cert": self.tls[0] if self.tls else None}

    def worker_routes(self) -> dict:
        """What each rank's ``PSSync`` needs: a route per shard, and the clock keeper under asp/ssp."""
        return {"shards": [self.route(i) for i in range(len(self.handles))], "keeper": self.keeper}

    def publish_routes(self, group) -> None:
        """Every rank the group forms from now on (a replacement, a relaunched grid) gets the shards' current
        routes: a restarted or added shard has a new actor and gRPC address."""
        group.worker_extra = {"ps_routes": self.worker_routes()}

    # -- between steps -------------------------------------------------------------------------

    def arm(self, fault: dict) -> None:
        """A ``kill_ps_shard`` fault (``FaultSchedule.for_controller``): the shard dies during the coming step."""
        answer(self.handles[fault["shard"]].arm_kill.remote(1), f"shard {fault['shard']} (arming kill_ps_shard)",
               self.deadline_s)
        event("fault", kind="kill_ps_shard", shard=fault["shard"], at_step=fault["at_step"])
        self._armed[fault["shard"]] = (fault["at_step"], time.perf_counter())

    def after_step(self, step: int, group) -> None:
        """Restart and resync dead shards, change the shard count when ``parameter_server.resize`` says the next
        step runs on another, then snapshot on the cadence or after a resize (asp/ssp workers paused meanwhile)."""
        alive = self._alive()
        every = self.ps.snapshot_every
        count = self.ps.shards_at(step + 1)
        snapshot = every and (step % every == 0 or count != len(self.handles))
        if all(alive) and not snapshot and count == len(self.handles):
            return
        restarted = [shard for shard, ok in enumerate(alive) if not ok]
        with self._paused():
            self._restart_dead(alive, group, step, reroute=False)
            resizing = count != len(self.handles)
            if resizing:
                self.resizes.append(ps_resize.resize(self, count, step))
                self._write_routes()
            if snapshot:
                paths = [str(self.run_dir / "ps" / f"shard-{i}.pt") for i in range(len(self.handles))]
                answer([h.save.remote(p) for h, p in zip(self.handles, paths)], "the shards' snapshot",
                       self.deadline_s)
            self._tell_ranks(group, restarted, resizing)

    def _tell_ranks(self, group, restarted: list[int], resized: bool) -> None:
        """Point the ranks at restarted shards or the new ring, last: every shard-side change is done and recorded
        by then, and the routes published, so a rank lost here (``StepFailed``, recovered by the controller) loses
        no record and its replacement is formed with the live shards."""
        self.publish_routes(group)
        if resized:  # every route, the restarted shards' too
            group.call("ps_reshard", [self.route(i) for i in range(len(self.handles))])
            return
        for shard in restarted:
            group.call("ps_reroute", shard, self.route(shard))

    def heal(self, step: int, group, reroute: bool = True) -> None:
        """Restart and resync every shard that does not answer a ping, before a call that reaches every shard
        (``keep``, ``abort``, a rollback or restore): a shard lost during the step would fail that call, and the run
        with it, although the restart ``after_step`` does recovers it. ``reroute=False``: the group's step failed
        and it cannot be called; its next ``form`` hands every rank the new routes (``publish_routes``)."""
        alive = self._alive()
        if not all(alive):
            self._restart_dead(alive, group, step, reroute)

    def _restart_dead(self, alive: list[bool], group, step: int, reroute: bool = True) -> None:
        """Restart every shard ``alive`` says is dead (see ``_restart``)."""
        for shard, ok in enumerate(alive):
            if not ok:
                self._restart(shard, alive, group, step, reroute)

    @contextmanager
    def _paused(self):
        """asp/ssp: no worker step runs inside (the shards and the clock keeper agree); bsp: nothing to pause,
        the shards are quiet between steps."""
        if self.keeper is not None:
            answer(self.keeper.pause.remote(), "the clock keeper (pausing the workers)", self.deadline_s)
        try:
            yield
        finally:
            if self.keeper is not None:
                answer(self.keeper.resume.remote(), "the clock keeper (resuming the workers)", self.deadline_s)

    # -- checkpoints ---------------------------------------------------------------------------

    def whole_state(self) -> dict:
        """Every shard's parameters and optimizer state, joined into whole tensors by name, and the clocks
        (``parameter_server.checkpoint``)."""
        with self._paused():
            states = answer([h.state.remote() for h in self.handles], "the shards' state", self.deadline_s)
            clocks = {"workers": self.spec.parallel.dp, "version": states[0]["version"],
                      "applied_from": states[0]["applied_from"]}
            if self.keeper is not None:
                kept = answer(self.keeper.state.remote(), "the clock keeper's state", self.deadline_s)
                clocks.update(keeper_clocks=kept["clocks"], completed=kept["completed"])
        return checkpoint.whole(states, self.ps.chunk_elems, clocks)

    def save_checkpoint(self, path) -> None:
        """Into a checkpoint's folder, beside the ranks' files (``Checkpointing.beside_ranks``)."""
        checkpoint.save(self.whole_state(), path)
        event("ps_checkpoint", path=path, shards=len(self.handles))

    def restore_checkpoint(self, path, step: int) -> None:
        """The shards (and under asp/ssp the clocks) as ``path`` holds them, split for this job's ring: another
        shard count, chunk size or (bsp) number of data ranks than the saving job's is fine."""
        from workers.state.dcp_reading import dcp_load, read_metadata

        flat = checkpoint.load(path, read_metadata, dcp_load)  # reading runs no code the files may carry
        if flat is None:
            raise RuntimeError(f"--resume with parallel.dp_sync: ps: checkpoint {path} holds no parameter-server "
                               "state (it was saved by a run without dp_sync: ps), so the shards' optimizer state "
                               "is not there; fix: resume it with parallel.dp_sync: allreduce, or start afresh")
        self.restore(flat, step)

    def restore(self, flat: dict, step: int) -> None:
        """Load ``whole_state``'s answer into every shard (bsp: at clock ``step``)."""
        clocks = checkpoint.clocks(flat)
        dp, pp = self.spec.parallel.dp, self.spec.parallel.pp
        if self.keeper is not None and clocks["workers"] != dp:
            raise RuntimeError(f"--resume with parameter_server.consistency {self.ps.consistency}: the checkpoint "
                               f"was saved with parallel.dp={clocks['workers']}, this job has dp={dp}, and each "
                               "worker's clock belongs to one data rank; fix: resume at "
                               f"parallel.dp={clocks['workers']}, or with consistency: bsp")
        self._check_names(flat)
        states = checkpoint.shard_states(flat, self.ring, self.ps.chunk_elems, self.ps.server_optim(self.spec.optim))
        for state in states:
            state["version"] = step if self.keeper is None else clocks["version"]
            state["applied_from"] = clocks["applied_from"] if clocks["workers"] == dp else [0] * (dp * pp)
        answer([h.restore.remote(st) for h, st in zip(self.handles, states)], "the shards (restoring)",
               self.deadline_s)
        if self.keeper is not None:
            answer(self.keeper.restore.remote(clocks["keeper_clocks"], clocks["completed"]),
                   "the clock keeper (restoring)", self.deadline_s)

    def layout(self, shard: int = 0) -> dict[str, dict]:
        """The model's layout (tensor name -> shape, dtype) as shard ``shard`` (a live one) registered it."""
        return self.answer(self.handles[shard].clock.remote(), f"shard {shard} (the model's layout)")["layout"]

    def _alive(self) -> list[bool]:
        """Which shards answer a ping (``ping_shards``)."""
        return ping_shards(self.handles)

    def _restart(self, shard: int, alive: list[bool], group, step: int, reroute: bool = True) -> None:
        """A new actor for dead shard ``shard``, resynced from the live holders of its keys; the routes are
        published before the group is called, so a rank formed after a failed reroute gets the live shard."""
        ray.kill(self.handles[shard], no_restart=True)
        self.handles[shard] = self._new_shard(shard)
        self.addresses[shard] = answer(self._serve(shard), f"restarted shard {shard} (its gRPC server)",
                                       self.deadline_s)
        self._check_certificate([shard])
        keys = self._resync(shard, alive)
        self.publish_routes(group)
        self._write_routes()
        at_step, t0 = self._armed.pop(shard, (step, time.perf_counter()))
        self.recoveries.append({"kind": "kill_ps_shard", "rank": -1, "shard": shard, "at_step": at_step,
                                "lost_steps": 0, "source": "replica", "mttr_s": time.perf_counter() - t0})
        event("ps_shard_restarted", shard=shard, keys=keys, step=step)
        if reroute:  # last: a rank lost here (``StepFailed``) finds the shard restarted and recorded
            group.call("ps_reroute", shard, self.route(shard))

    def _resync(self, shard: int, alive: list[bool]) -> int:
        """Every key of restarted shard ``shard`` from its live holder, now and in every step kept for a rollback
        (``handover``/``take``, as a resize moves chunks): a rollback of the ranks to a kept step then finds the
        restarted shard's part too, instead of falling back to disk. Returns how many keys it holds."""
        live = [other for other, ok in enumerate(alive) if ok]
        if not live:
            return 0
        mine = [k for k in layout_keys(self.layout(live[0]), self.ps.chunk_elems) if shard in self.ring.holders(k)]
        bundles = answer([self.handles[other].handover.remote(mine) for other in live],
                         f"the live shards (their keys, to resync shard {shard})", self.deadline_s)
        held = answer([self.handles[shard].take.remote(b) for b in bundles],
                      f"restarted shard {shard} (loading its keys)", self.deadline_s)
        return held[-1]

    def check_keys_held(self, step: int) -> None:
        """Before recovering a failed step: when two or more shards are gone, a key whose holders all died has no
        copy left to resync from. The run ends here, naming those keys and the steps whose updates went with
        them (since the dead holders' latest disk snapshot, ``parameter_server.snapshot_every``), instead of
        replacing ranks that would only fail again on the same keys. (Restoring such a shard from its snapshot
        plus replayed pushes is not done: no push is kept for replay.)"""
        alive = self._alive()
        dead = [s for s, ok in enumerate(alive) if not ok]
        if len(dead) < 2:
            return
        layout = self.layout(alive.index(True)) if any(alive) else {}
        message = lost_updates(self.ring, self.ps.chunk_elems, layout, dead, self._snapshot_versions(dead), step)
        if message:
            raise RuntimeError(message)

    def _snapshot_versions(self, shards: list[int]) -> dict[int, int | None]:
        """The version each shard's latest disk snapshot holds (None: it has none, or none that reads as one);
        memory-mapped, so a shard file of many GB is not read to learn one integer."""
        out = {}
        for shard in shards:
            version = _snapshot_version(self.run_dir / "ps" / f"shard-{shard}.pt")
            # bsp counts steps; asp/ssp count pushes, one per worker (stage of a replica) per local step
            pushers = self.spec.parallel.dp * self.spec.parallel.pp
            out[shard] = version // pushers if version is not None and self.keeper else version
        return out

    def _check_names(self, flat: dict) -> None:
        """The keys are per pipeline stage and tensor-parallel slice: a checkpoint of another pp or tp layout
        has other names (refused naming them, before any shard changes)."""
        clocks = answer([h.clock.remote() for h in self.handles], "the shards' layout", self.deadline_s)
        held = {name for c in clocks for name in c["layout"]}
        saved = {k.removeprefix(checkpoint.PARAM) for k in flat if k.startswith(checkpoint.PARAM)}
        if saved != held:
            raise RuntimeError(f"--resume with parallel.dp_sync: ps: the checkpoint's shard keys do not match this "
                               f"layout's (only in the checkpoint: {sorted(saved - held)[:3]}, only here: "
                               f"{sorted(held - saved)[:3]}): PS keys follow the pipeline stages and tensor-parallel "
                               "slices; fix: resume at the saving job's parallel.pp and parallel.tp (dp and "
                               "parameter_server.shards may change)")

    # -- rolling back with the ranks (bsp) ------------------------------------------------------

    def keep(self, step: int, group) -> None:
        """bsp: every shard keeps its state at ``step``, beside the ranks' in-memory snapshot of it (a shard lost
        in the step is restarted first). (asp/ssp keep nothing: a lost rank's replacement rejoins at the shards'
        current state, ``rejoin``.)"""
        if self.keeper is None:
            self.heal(step, group)
            answer([h.keep.remote(step) for h in self.handles], f"the shards (keeping step {step})", self.deadline_s)

    def roll_back(self, step: int) -> None:
        """bsp: every shard back to the state it kept at ``step``; ``LookupError`` when one has none."""
        if self.keeper is None:
            answer([h.roll_back.remote(step) for h in self.handles], f"the shards (rolling back to step {step})",
                   self.deadline_s)

    @property
    def asynchronous(self) -> bool:
        return self.keeper is not None

    def abort(self, dead: set[int], group, step: int) -> None:
        """Ranks ``dead`` died mid-step. bsp: the shards drop that step's pushes and end the survivors' waits at
        once. asp/ssp: the shards keep everything (an acknowledged push stays applied); the clock keeper hands
        the dead workers' unfinished steps back and ends the survivors' rounds once their steps in flight are
        done (``ClockKeeper.hand_over``); nobody starts a step until ``rejoin``."""
        if self.keeper is None:
            self.heal(step, group, reroute=False)  # the group's step failed: its re-forming hands out the routes
            answer([h.abort.remote() for h in self.handles], "the shards (aborting the failed step)", self.deadline_s)
            return
        grid = self.spec.parallel.grid
        workers = sorted({grid.coords(r).dp for r in dead})
        kept = answer(self.keeper.hand_over.remote(workers), "the clock keeper (handing over lost workers)",
                      self.deadline_s)
        event("ps_workers_lost", workers=",".join(map(str, workers)), clocks=",".join(map(str, kept["clocks"])))

    def rejoin(self, group, step: int) -> None:
        """asp/ssp, after a re-formed group: every worker (replacement or survivor) continues at its clock from
        the shards' current parameters, then the keeper lets steps start again. Nothing is rolled back."""
        clocks = group.call("ps_resume", step)
        answer(self.keeper.resume.remote(), "the clock keeper (resuming the workers)", self.deadline_s)
        fields = {"clocks": ",".join(map(str, clocks))}
        if self.ps.compression == "topk":  # survivors keep their held-back gradient; a replacement starts at 0
            fields["feedback_chunks"] = ",".join(map(str, group.call("ps_feedback_chunks")))
        event("ps_workers_rejoined", step=step, **fields)

    # -- end of run ----------------------------------------------------------------------------

    def write_read_log(self) -> None:
        """Every asp/ssp read the shards recorded (reader clock, fewest pushes applied), for checking the bound."""
        with open(self.run_dir / "ps_reads.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.removed_reads)
            for h in self.handles:
                try:
                    log = ray.get(h.read_log.remote(), timeout=PING_S)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    continue  # a shard lost as the job failed: its reads are gone with it
                f.writelines(json.dumps(r) + "\n" for r in log)

    def stop(self) -> None:
        for h in self.handles + ([self.keeper] if self.keeper is not None else []):
            ray.kill(h)


def _snapshot_version(path: Path) -> int | None:
    """The version in the shard snapshot at ``path``, None when there is none. Read as tensors and plain values
    only (``weights_only``): the file lies in the run directory, and a full unpickle would run whatever code a
    file planted there names, in the controller. One that does not read so (planted, half written) counts as
    no snapshot, so the lost-keys message still names what is lost."""
    if not path.is_file():
        return None
    try:
        return int(torch.load(path, mmap=True, weights_only=True)["version"])
    except (pickle.UnpicklingError, RuntimeError, KeyError, TypeError):
        return None


def ping_shards(handles: list) -> list[bool]:
    """Which shards answer a ping within ``PING_S``. One Ray calls unavailable (a dropped connection, seen on a
    live shard when a rank on its node was SIGKILLed) is pinged again after the shards' client's waits
    (``UNAVAILABLE_RETRY_S``): restarting a live shard costs a resync and drops the reads it logged. Only a shard
    that does not answer, that Ray says died, or that stays unavailable is reported dead."""
    state = _ping(handles)
    for wait_s in UNAVAILABLE_RETRY_S:
        again = [i for i, s in enumerate(state) if s == "unavailable"]
        if not again:
            break
        time.sleep(wait_s)
        for i, s in zip(again, _ping([handles[i] for i in again])):
            state[i] = s
    return [s == "alive" for s in state]


def _ping(handles: list) -> list[str]:
    """One ping of each shard at once: "alive", "unavailable" (Ray may reach it again) or "dead"."""
    refs = [h.ping.remote() for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PING_S)
    out = []
    for ref in refs:
        try:
            out.append("alive" if ref in ready and ray.get(ref) is not None else "dead")
        except ray.exceptions.ActorUnavailableError:
            out.append("unavailable")
        except ray.exceptions.RayActorError:
            out.append("dead")
    return out


def lost_updates(ring: HashRing, chunk_elems: int, layout: dict, dead: list[int], snapshots: dict[int, int | None],
                 step: int) -> str:
    """What is lost when shards ``dead`` are all gone (``""``: every key still has a live holder): the chunk keys
    whose holders all died, and, per key, the steps since the newest disk snapshot that holds it (``snapshots``:
    shard -> the version, the step, its snapshot was taken at)."""
    lost: dict[int, list[str]] = {}  # steps since the snapshot -> keys
    for key in layout_keys(layout, chunk_elems):
        holders = ring.holders(key)
        if all(h in dead for h in holders):
            since = max((snapshots.get(h) or 0) for h in holders)
            lost.setdefault(since, []).append(key)
    if not lost:
        return ""
    parts = [f"{len(keys)} chunks ({', '.join(keys[:8])}{', ...' if len(keys) > 8 else ''}) " + _since(since, step)
             for since, keys in sorted(lost.items())]
    return (f"parameter server: shards {', '.join(map(str, dead))} are all gone, and with them both holders of some "
            f"keys: {'; '.join(parts)}. The run stops rather than train on without them; fix: resume from the "
            "latest checkpoint (`raymesh run JOB --resume`), and set parameter_server.snapshot_every (or "
            "checkpoint.every) to bound what such a loss costs")


def _since(snapshot: int, step: int) -> str:
    if snapshot >= step:
        return (f"lose no update, their disk snapshot being of step {snapshot}, but a shard is not restored from its "
                "snapshot")
    held = f"their newest disk snapshot is of step {snapshot}" if snapshot else "no disk snapshot holds them"
    return f"lose the updates of steps {snapshot + 1} to {step} ({held})"
