"""The rank actors of one job: start them, run their windows of steps, and replace the ones that fail.

The ranks run their own loop (``RankWorker.run_window``); the group reads rank 0's desk
(``window_items``: one long poll per call, whatever the world size) and posts the
controller's requests there. A window either ends on every rank or raises
``StepFailed`` naming the ranks that died (actor or process gone), hung (no
progress within the deadline) or raised on their own (out of memory, an I/O error,
a bug); those are killed so they count as dead.
Survivors in a collective with the dead peer get an error from gloo at once
(its sockets closed), and each rank whose step failed shuts its own gloo
connections (``workers.group_sockets``), so those blocked on a survivor fail
at once too; any still blocked (NCCL) are not waited for past a short grace
(``finish_failed_step``): a failed step ends within seconds, not the collective
timeout, and the replacements start meanwhile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import ClassVar, NoReturn

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator.events import event
from orchestrator.planning.snapshot_memory import replicas_mirror
from orchestrator.recovery.keep_training import survivor_specs
from orchestrator.recovery.policy import ranks_that_failed
from orchestrator.recovery.snapshot_target import newest_common_step, replica_holders
from orchestrator.runtime.group import ABANDONED, PREEMPTED, StepFailed
from orchestrator.runtime.placement import RankPlacement
from orchestrator.spec import JobSpec
from workers.agent import NodeAgent
from workers.diagnostics.faults import RankStepError
from workers.loop.loop import HUNG
from workers.loop.plan import Request, StepRecord, Window
from workers.protocol import RankInfo
from workers.rank_worker import RankWorker

# a hang's diagnosis: how long the ranks have to say where their loop is (a stopped process is not waited for) and
# to hand over their stacks; the detection's record (``StepFailed.detection``) shows what the two took
WHERE_S = 5.0
STACKS_S = 3.0


def step_error(exc: ray.exceptions.RayTaskError) -> RankStepError:
    """The worker's classified failure inside Ray's wrapper (any other exception counts as an ``error``)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, RankStepError) else RankStepError("error", str(exc).splitlines()[0][:300])


class RankGroup:
    """The ``RankWorker`` actors of one grid (what ``group.RankGroupLike`` describes, on Ray)."""

    worker_extra: ClassVar[dict] = {}  # extra keys for the workers' spec dict (``ps_routes`` under dp_sync: ps)

    def __init__(self, spec: JobSpec, placement: RankPlacement, use_gpu: bool):
        self.spec = spec
        self.placement = placement
        self.use_gpu = use_gpu
        self.workers: list = [self._new_actor(r) for r in range(spec.parallel.world_size)]
        self._failed: list[int] = []  # the ranks whose loop of the failed window was not seen to end
        self._holders: dict[int, int | None] = {}  # rank -> its replica holder, chosen at every formation
        self._node_of: dict[int, str] = placement.nodes()  # rank -> its node (its bundle's; each formation's)
        self._agents: dict[str, object] = {}  # node -> its NodeAgent, which carries calls to the node's ranks
        self._adopt(range(len(self.workers)))
        self._spares: dict[str, object] = {}  # node -> a preloaded spare rank process (``start_spares``)
        self._last_step_s = 0.0  # wall time of the last completed step (the survivors' grace scales with it)
        self._last_record: float | None = None  # rank 0's clock at the window's last step record
        self._record_step = 0  # the step of the last step record (a hang's diagnosis is named after the next)
        self._window_id, self._cursor = 0, 0  # the window running, and the number of rank 0's next item
        # recovery: keep_training: the grid ranks of the smaller group the surviving replicas step in (None: all),
        # and the preloads of the failed ranks' replacements (done: the replacement is up)
        self._live: list[int] | None = None
        self._starting: dict[int, object] = {}

    @property
    def members(self) -> list[int]:
        """The ranks of the group that steps: every rank, or the surviving replicas while others are rebuilt."""
        return self._live if self._live is not None else list(range(len(self.workers)))

    @property
    def _root(self):
        """The rank actor holding the desk: rank 0 of the group that steps."""
        return self.workers[self.members[0]]

    def _new_actor(self, rank: int, spare: bool = False):
        """A ``RankWorker`` in ``rank``'s placement bundle; a ``spare`` reserves no resources of its own (it takes
        over the dead rank's, freed in the same bundle's node)."""
        p = self.spec.parallel
        # peers' replicas are stored on their own thread, beside the running step
        # and rank 0's desk answers the controller on its own thread while the rank's loop runs
        return ray.remote(concurrency_groups={"replicas": 1, "control": 2})(RankWorker).options(
            num_cpus=0 if spare else p.cpus_per_rank,
            num_gpus=1 if self.use_gpu else 0,
            scheduling_strategy=self.placement.strategy(rank),
            name=f"{self.spec.name}-{'spare' if spare else 'rank'}{rank}-{time.time_ns()}",
        ).remote()

    # -- one call per node: the agents ----------------------------------------------------------

    def _adopt(self, ranks) -> None:
        """The agents of the ranks' nodes (started where none runs yet) take these ranks' actors; an agent left
        with no rank (its node was lost, its ranks now run elsewhere) goes."""
        for node in set(self._agents) - set(self._node_of.values()):
            ray.kill(self._agents.pop(node))
        by_node: dict[str, dict] = {}
        for rank in ranks:
            by_node.setdefault(self._node_of[rank], {})[rank] = self.workers[rank]
        for node, workers in by_node.items():
            if node not in self._agents:
                self._agents[node] = ray.remote(NodeAgent).options(
                    num_cpus=0, max_concurrency=16, name=f"{self.spec.name}-agent-{node[:12]}-{time.time_ns()}",
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            ray.get(self._agents[node].adopt.remote(workers))

    def _by_node(self, ranks) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for rank in ranks:
            out.setdefault(self._node_of[rank], []).append(rank)
        return out

    def _kill(self, ranks) -> None:
        """Kill these ranks: their processes by the kernel, through their nodes' agents (``NodeAgent.kill``: a
        frozen process never runs the exit ``ray.kill`` asks of it), then their actors in Ray."""
        ranks = list(ranks)
        calls = [self._agents[node].kill.remote(group) for node, group in
                 self._by_node(r for r in ranks if r in self._node_of).items() if node in self._agents]
        ray.wait(calls, num_returns=len(calls), timeout=10)
        for rank in ranks:
            ray.kill(self.workers[rank], no_restart=True)

    def _each(self, method: str, args: tuple = (), per_rank: dict[int, tuple] | None = None) -> list:
        """``method`` on every rank (``per_rank``: on those ranks, each with its own arguments), one call per node
        through its agent; the answers in rank order, within a deadline. A rank that died or did not answer by then
        is killed and fails the call as ``StepFailed``, which the controller recovers from like a failed step (a
        rank's own exception is raised as it is). The deadline is five heartbeat timeouts (10 minutes by default):
        long enough to load a large checkpoint, never forever."""
        ranks = sorted(per_rank) if per_rank is not None else self.members
        timeout = 5 * self.spec.fault_tolerance.heartbeat_timeout_s
        calls = {node: self._agents[node].call.remote(
                     method, args, None if per_rank is None else {r: per_rank[r] for r in group}, timeout)
                 for node, group in self._by_node(ranks).items()}
        answers = self._answers(calls, timeout + 30)
        dead = {r: how for r, (how, _) in answers.items() if how in ("died", "hung")}
        if dead:
            self._kill(dead)
            raise StepFailed(dead)
        raised = [value for _, (how, value) in sorted(answers.items()) if how == "raised"]
        if raised:
            raise raised[0]
        return [answers[r][1] for r in ranks]

    def _answers(self, calls: dict, timeout_s: float) -> dict[int, tuple]:
        """Every rank's answer from its agent's (an agent's ``start`` answers nothing: its ranks are ``ok``); the
        ranks of an agent that died (its node) count as died."""
        out: dict[int, tuple] = {}
        ranks_on: dict[str, list[int]] | None = None  # node -> its ranks, made once, only when needed
        for node, ref in calls.items():
            try:
                answer = ray.get(ref, timeout=timeout_s)
            except ray.exceptions.RayError:
                answer = None
                how = ("died", None)
            else:
                how = ("ok", None)
            if not isinstance(answer, dict):
                ranks_on = ranks_on if ranks_on is not None else self._by_node(self._node_of)
                answer = dict.fromkeys(ranks_on.get(node, []), how)
            out.update(answer)
        return out

    def start_spares(self) -> None:
        """One warm spare rank process per node of the grid (CPU jobs), started and preloaded in the background.

        Why: a replacement spends most of its time starting Python and importing torch (3 to 7 s on a loaded
        host, more for two at once), the largest part of a recovery once survivors are not waited for; a
        spare has done that already. CPU only: a spare on a GPU would need a GPU of its own. Called after the
        grid trains, so the spares' imports never compete with the ranks' start-up. Off with
        ``fault_tolerance.warm_spares: false``.
        """
        if self.use_gpu or not self.spec.fault_tolerance.warm_spares:
            return
        first_of = {}
        for rank, node in self._node_of.items():
            first_of.setdefault(node, rank)
        for node, rank in first_of.items():
            if node not in self._spares:
                self._spares[node] = self._new_actor(rank, spare=True)
                self._spares[node].preload.remote()

    def form(self, keep: bool = False) -> list[RankInfo]:
        """(Re)join every rank into a fresh process group and build its model; returns each rank's info.
        ``keep`` (``recovery: keep_training``'s rejoin): ranks that have a trainer keep it and only join the new
        group (``RankWorker.setup``); the replacements build theirs."""
        world = self.spec.parallel.world_size
        self._live, self._starting = None, {}
        self._each("preload")  # new actors import first
        one_node = len(set(self._node_of.values())) == 1  # then the store listens on loopback only
        addr, port = self._each("rendezvous_address", per_rank={0: (one_node,)})[0]
        worker_spec = {**self.spec.worker_dict(), **self.worker_extra}
        infos = self._each("setup", per_rank={r: (worker_spec, r, world, addr, port, keep) for r in range(world)})
        self._holders = replica_holders(self.spec.parallel.grid, self._node_of)
        # a mirror's holder already has the same state in its own snapshots: nothing to ship
        self._each("set_holder", per_rank={r: (None if self.mirrored else self._holder_actor(r),)
                                          for r in range(world)})
        return infos

    def start_window(self, window: Window, window_id: int) -> None:
        """Every rank starts its loop on ``window`` (one call per rank per window, never per step)."""
        self._window_id, self._cursor, self._last_record = window_id, 0, None
        window = self._as_stepping(window)
        notify = (self._root, window_id)  # an agent seeing a rank fail says so on rank 0's desk at once
        calls = {node: agent.start.remote("run_window", (window, window_id), notify)
                 for node, agent in self._agents.items()}
        lost = {r: how for r, (how, _) in self._answers(calls, 60.0).items() if how == "died"}
        if lost:  # a node (and its agent) went between two windows
            raise StepFailed(lost)

    def form_without(self, dead) -> list[RankInfo]:
        """``recovery: keep_training``: the other ranks re-form a smaller process group without ``dead``, keeping
        their trainers (``RankWorker.setup``; state: ``restore`` next puts back what the failed step moved),
        numbered in grid order, each reading the share of every global batch its grid position reads
        (``data_slot``); the dead ranks' nodes' agents let go of them until their replacements rejoin (``form``)."""
        dead = set(dead)
        for node, gone in self._by_node(r for r in dead if r in self._node_of).items():
            if node in self._agents:
                ray.get(self._agents[node].adopt.remote(dict.fromkeys(gone)))
        self._live = [r for r in range(len(self.workers)) if r not in dead]
        one_node = len({self._node_of[r] for r in self._live}) == 1
        addr, port = self._each("rendezvous_address", per_rank={self._live[0]: (one_node,)})[0]
        specs, world = survivor_specs(self.spec, self._live, self.worker_extra), len(self._live)
        infos = self._each("setup", per_rank={r: (specs[r], i, world, addr, port, True)
                                              for i, r in enumerate(self._live)})
        self._each("set_holder", per_rank={r: (None,) for r in self._live})  # zero 0: every snapshot a mirror
        return infos

    def replacements_ready(self, ranks) -> bool:
        """Whether the replacements of ``ranks`` have started and imported (their preload answered, or failed:
        ``placed`` then starts a failed one again), without waiting."""
        refs = [self._starting[r] for r in ranks if r in self._starting]
        return not refs or len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs)

    def _as_stepping(self, item):
        """A window or request with its faults' grid ranks as the ranks of the group that steps (a fault of a rank
        outside it is dropped): under ``keep_training`` the survivors are numbered 0.. in their smaller group."""
        if self._live is None:
            return item
        new = {r: i for i, r in enumerate(self._live)}
        if isinstance(item, Request):
            return dataclasses.replace(item, faults=tuple({**f, "rank": new[f["rank"]]} for f in item.faults
                                                          if f.get("rank") in new),
                                       preempted=tuple(new[r] for r in item.preempted if r in new))
        faults = {step: {new[r]: f for r, f in by_rank.items() if r in new} for step, by_rank in item.faults.items()}
        return dataclasses.replace(item, faults=faults, slow={new[r]: f for r, f in item.slow.items() if r in new})

    def window_items(self, wait_s: float) -> list:
        """Rank 0's next items (waiting up to ``wait_s`` for one); ``StepFailed`` once its loop failed and every
        item before the failure was handed over, or when rank 0 itself is gone."""
        try:
            items, self._cursor = ray.get(self._root.desk_items.remote(self._window_id, self._cursor, wait_s),
                                          timeout=wait_s + self.spec.fault_tolerance.heartbeat_timeout_s)
        except (RayActorError, ray.exceptions.GetTimeoutError):
            self.window_failed()
        for item in items:  # the survivors' grace scales with a step (``finish_failed_step``)
            if isinstance(item, StepRecord):
                if self._last_record is not None:
                    self._last_step_s = item.time - self._last_record
                self._last_record, self._record_step = item.time, item.step
        return items  # a loop of rank 0 that raised says so on its desk; a dead rank 0's desk call fails above

    def post(self, request: Request) -> int | None:
        try:
            return ray.get(self._root.desk_post.remote(self._window_id, self._as_stepping(request)), timeout=30)
        except ray.exceptions.RayError:
            return None  # rank 0 is gone: the window is failing, and the controller acts on it before the next

    def window_failed(self) -> None:
        """Which ranks failed the window, from every agent's account of its ranks' loops in a few passes (each
        rank whose loop broke only because a peer's did is a survivor); raises ``StepFailed``. The ranks still
        running after the last pass are handed to ``finish_failed_step``."""
        outcomes: dict[int, str] = {}
        for wait_s in (0.2, 1.0, self.spec.fault_tolerance.survivor_grace_s):
            outcomes = self._loop_outcomes(wait_s)
            if any(how != "peer_lost" for how in outcomes.values()) or len(outcomes) == len(self.members):
                break
        dead = {rank: how for rank, how in outcomes.items() if how != "peer_lost"}
        if not dead:  # only broken collectives, no rank to blame (or none answered): all are replaced
            dead = {rank: "hung" for rank in self.members if rank not in outcomes} or \
                ranks_that_failed({rank: RankStepError("peer_lost", "") for rank in outcomes})
        self._kill(dead)
        self._failed = [r for r in self.members if r not in outcomes and r not in dead]
        raise StepFailed(dead)

    def window_hung(self, silent_s: float) -> NoReturn:
        """No step completed within the progress deadline: every rank says where its loop is (one call per node,
        five seconds to answer, none waited for where the process is stopped: ``NodeAgent.where``). The stuck ranks
        are those that do not answer (a frozen process); when all answer, those still inside a step, snapshot or
        save (their peers wait for them at the boundary); when none can be told apart that way, every rank. They
        are killed, which ends their peers' collectives with them at once,
        and the window fails as ``StepFailed`` with them ``hung``."""
        self.post(Request(stop=HUNG))  # a step that completes during the diagnosis fails: nothing of it is kept
        calls = {node: agent.where.remote(WHERE_S) for node, agent in self._agents.items()}  # a stopped rank: at once
        answers = self._answers(calls, 35.0)
        where = {r: value for r, (how, value) in answers.items() if how == "ok"}
        stuck = set(answers) - set(where) or {r for r, p in where.items() if p["phase"] in ("step", "snapshot", "save")}
        stuck = stuck or set(self.members)
        first = where.get(min(stuck), {})
        kept = self._diagnose()
        event("hang_detected", silent_s=f"{silent_s:.1f}", ranks=sorted(stuck)[:16], count=len(stuck),
              phase=first.get("phase", "no answer"), where=" < ".join(first.get("where", [])), stacks=kept)
        self._kill(stuck)
        self._failed = [r for r in self.members if r not in stuck]
        raise StepFailed(dict.fromkeys(stuck, "hung"), stacks=kept)

    def preempted(self, ranks, leave: tuple[str, ...] = ()) -> NoReturn:
        """Grid ranks whose processes had a preemption notice, or whose node is being drained, and saved their step
        (``RankLoop._decide``): killed now, rather than left to the platform's SIGKILL, and failed as ``StepFailed``
        so they are replaced. Their loops' calls are let end first: a death seen before them would be reported to
        rank 0's desk as a failure. ``leave``: nodes being drained; the placement groups there are reserved again
        elsewhere (``RankPlacement.move_off``) and their spares go, so no replacement starts there."""
        self._loop_outcomes(10.0, ranks)
        self._kill(ranks)
        if leave:
            for node in set(leave) & set(self._spares):
                ray.kill(self._spares.pop(node))
            moved = self.placement.move_off(set(leave))
            event("placement_moved", off=",".join(leave), groups=moved)
        self._failed = []
        raise StepFailed(dict.fromkeys(ranks, PREEMPTED))

    def _diagnose(self) -> str:
        """Every rank's Python stacks, all threads, frozen ranks too (``NodeAgent.stacks``), and on NCCL each
        answering rank's flight-recorder trace, written into ``<run_dir>/hangs/step<N>/`` before anything is
        killed; returns that directory. A rank that wrote nothing (gone, or never started) has no file; the
        directory's ``missing.txt`` names it."""
        out = self.spec.resolved_run_dir() / "hangs" / f"step{self._record_step + 1}-window{self._window_id}"
        out.mkdir(parents=True, exist_ok=True)
        texts: dict[int, str] = {}
        for ref in [agent.stacks.remote(STACKS_S) for agent in self._agents.values()]:
            with contextlib.suppress(ray.exceptions.RayError):
                texts.update(ray.get(ref, timeout=20))
        for rank, text in texts.items():
            (out / f"rank{rank}.txt").write_text(text)
        missing = sorted(set(self.members) - set(texts))
        if missing:
            (out / "missing.txt").write_text(f"no stack from ranks {missing}: gone, or never started\n")
        if self.use_gpu:
            self._flight_records(out)
        return str(out)

    def _flight_records(self, out) -> None:
        """NCCL's flight-recorder trace of each rank that answers within five seconds (``RankWorker.flight_record``),
        as ``nccl-rank<N>.pkl``."""
        calls = {node: agent.call.remote("flight_record", (), None, 5.0) for node, agent in self._agents.items()}
        for rank, (how, trace) in self._answers(calls, 35.0).items():
            if how == "ok" and trace:
                (out / f"nccl-rank{rank}.pkl").write_bytes(trace)

    def _loop_outcomes(self, wait_s: float, ranks=None) -> dict[int, str]:
        """How each rank's loop of the window ended (``died``, a failure of its own, or ``peer_lost``, which a
        loop that ended normally while another failed counts as too), waiting up to ``wait_s``; a loop still
        running is left out."""
        nodes = self._by_node(self.members if ranks is None else ranks)
        calls = {node: self._agents[node].outcomes.remote(wait_s, group) for node, group in nodes.items()}
        out = {}
        for rank, (how, value) in self._answers(calls, wait_s + 30).items():
            if how == "hung":
                continue
            if how == "raised":
                error = step_error(value)
                how = "peer_lost" if error.kind == "peer_lost" else ranks_that_failed({rank: error})[rank]
            out[rank] = "peer_lost" if how == "ok" else how
        return out

    def finish_failed_step(self) -> dict[int, str]:
        """Wait a short grace for the other ranks' failed step to end; returns the ranks found dead meanwhile
        (a lost node takes several) and those still blocked after it (``abandoned``), all killed like the first.

        Why abandon: a survivor whose collective is with the dead rank fails at once (gloo sees the socket
        close), but one blocked on *another survivor* (the pipeline peer of the dead rank's data-parallel
        peer, say) would wait out ``collective_timeout_s`` (60 s by default): neither
        ``ProcessGroup.abort()`` nor ``shutdown()`` unblocks a pending gloo operation (measured on torch
        2.13). On gloo a rank whose step failed shuts its connections (``RankWorker._leave_group``), which
        ends its peers' pending operations at once, so the grace normally ends as soon as every failed step
        has; it remains the backstop (NCCL, a rank stuck elsewhere). Restarting a still blocked survivor costs
        what replacing the dead rank costs, in parallel with it, and its state comes back from its
        data-parallel replica (the zero-0 mirrors, or the replica it shipped), else from disk. On NCCL the
        same place is where PyTorch's own error handling would tear the process down after the timeout;
        abandoning after the grace gets there sooner (``ProcessGroupNCCL.abort()`` is not verified here).

        The grace is ``fault_tolerance.survivor_grace_s`` or twice the last completed step, whichever is
        longer, so a survivor still computing its share of a long step is not mistaken for a blocked one.
        """
        ranks, self._failed = self._failed, []
        if not ranks:
            return {}
        grace = min(max(self.spec.fault_tolerance.survivor_grace_s, 2 * self._last_step_s),
                    self.spec.fault_tolerance.collective_timeout_s + 5)
        over = self._loop_outcomes(grace, ranks)  # a loop that broke with the dead peer: a survivor
        dead = {r: "died" for r, how in over.items() if how == "died"}
        dead.update({r: ABANDONED for r in ranks if r not in over})
        self._kill(dead)
        return dead

    def replace(self, ranks) -> None:
        """New actors in the dead ranks' grid positions (their placement bundles are free again); they start
        importing torch and the trainer at once, while the survivors finish their failed step."""
        for rank in ranks:
            spare = self._spares.pop(self._node_of.get(rank), None)
            self.workers[rank] = spare if spare is not None else self._new_actor(rank)
            self._starting[rank] = self.workers[rank].preload.remote()

    def prebuild(self, ranks) -> None:
        """``recovery: keep_training``: the replacements of ``ranks`` build their trainers alone once imported
        (``RankWorker.prebuild``), while the survivors step; ``replacements_ready`` then waits for that too, so the
        rejoin stops the survivors only for the rendezvous and a peer's state."""
        for rank in ranks:
            if rank in self._starting:  # calls to one actor run in order: after its preload
                solo = survivor_specs(self.spec, [rank], self.worker_extra)[rank]
                self._starting[rank] = self.workers[rank].prebuild.remote(solo)

    def placed(self, ranks, timeout_s: float) -> bool:
        """Whether the new actors of ``ranks`` started within ``timeout_s``.

        One that was scheduled onto a node Ray had not yet declared dead dies unstarted; it is started
        again (the placement group then moves its bundle to a live node, or waits for room). Those not
        started by the deadline are killed: their resources are gone, and the caller shrinks the grid.
        """
        deadline = time.monotonic() + timeout_s
        pending = {r: self.workers[r].__ray_ready__.remote() for r in ranks}
        while pending and time.monotonic() < deadline:
            ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for rank, ref in list(pending.items()):
                if ref not in ready:
                    continue
                try:
                    ray.get(ref)
                    del pending[rank]
                except RayActorError:
                    time.sleep(0.5)  # give Ray a moment to declare the node dead before placing again
                    self.workers[rank] = self._new_actor(rank)
                    pending[rank] = self.workers[rank].__ray_ready__.remote()
        for rank in pending:
            ray.kill(self.workers[rank], no_restart=True)
        started = [r for r in ranks if r not in pending]
        nodes = ray.get([self.workers[r].identity.remote() for r in started])  # a lost node's bundle moved
        self._node_of.update({r: info["node_id"] for r, info in zip(started, nodes)})
        self._adopt(started)
        return not pending

    def holder(self, rank: int) -> int | None:
        """Where rank's replica lives: a rank of the same position in another data-parallel replica, on another
        node whenever the cluster has one (``replica_holders``)."""
        return self._holders.get(rank, self.spec.parallel.grid.replica_peer(rank))

    @property
    def mirrored(self) -> bool:
        """Under plain all-reduce data parallelism (zero 0) the holder's own state is bit for bit the rank's
        (same all-reduced gradients, same optimizer steps, same global data position), so its own snapshot
        is the replica and none is shipped; ZeRO shards differ per dp rank and are shipped, and so is the state
        a rank keeps of its own (``dp_ranks_keep_their_own``: error feedback, microbatches in flight). BSP
        parameter-server ranks mirror too (``ps_replicas_mirror``)."""
        return replicas_mirror(self.spec)

    def _holder_actor(self, rank: int):
        holder = self.holder(rank)
        return None if holder is None else self.workers[holder]

    def snapshot(self, keep_from: int = -1) -> None:
        """Every rank snapshots its state now; replicas ship to the holders in the background.
        Snapshots of steps before ``keep_from`` (replicated by every rank) are dropped."""
        self._each("take_snapshot", (keep_from,))

    def _available(self, ranks) -> dict[int, dict]:
        """Each of ``ranks``' complete snapshot steps and replicas, once none is in flight."""
        ranks = list(ranks)
        return dict(zip(sorted(ranks), self._each("snapshot_steps", per_rank=dict.fromkeys(ranks, ()))))

    def restore(self, replaced: set[int], up_to: int) -> int:
        """Roll every rank back to the newest snapshot step, at most ``up_to``, complete for all of them:
        survivors from their own, replaced ranks from their holder's replica. Returns the step."""
        sources = {rank: self._source(rank, replaced) for rank in replaced}
        for rank, source in sources.items():
            if source is None:
                raise LookupError(f"the in-memory replica of rank {rank} died with it")
        avail = self._available(r for r in self.members if r not in replaced)
        lists = [held["own"] for held in avail.values()]
        if not self.mirrored:  # a mirror's replica is its holder's own snapshot, already in ``lists``
            lists += [avail[sources[r]]["replicas"].get(r, []) for r in replaced]
        step = newest_common_step(lists, up_to)
        if step is None:
            raise LookupError(f"no snapshot step up to {up_to} is complete on every rank and replica")
        calls = {rank: (step, self._replica(rank, sources[rank], step) if rank in replaced else None)
                 for rank in self.members}
        return self._each("restore_snapshot", per_rank=calls)[0]

    def _source(self, rank: int, replaced: set[int]) -> int | None:
        """The surviving rank that hands replaced ``rank`` its state: its holder; for mirrors, when the holder was
        replaced too (a lost node, or survivors restarted after the grace), any surviving rank of the same model
        position, whose own snapshot is the same state bit for bit. None when there is none."""
        holder = self.holder(rank)
        if holder is not None and holder not in replaced:
            return holder
        if not self.mirrored:
            return None
        grid = self.spec.parallel.grid
        return next((r for r in grid.ranks() if r not in replaced and grid.same_state(r, rank)), None)

    def _replica(self, rank: int, source: int, step: int):
        holder = self.workers[source]
        return holder.kept_snapshot.remote(step) if self.mirrored else holder.replica.remote(rank, step)

    def survivor_snapshots(self, dead: set[int], up_to: int) -> tuple[int, dict] | None:
        """A step and, per model position (pp, cp, tp), a surviving rank's snapshot of it, for a grid with another
        dp to start from.

        Only where data-parallel replicas are full copies (``mirrored``): ZeRO splits the state over dp,
        which only a DCP checkpoint can reshard. None also when every replica of a position died.
        """
        grid = self.spec.parallel.grid
        if not self.mirrored or grid.ep_enabled:  # a new dp re-splits the experts: only DCP reshards them
            return None
        chosen = {}
        for rank in grid.ranks():
            if rank not in dead:
                chosen.setdefault(grid.position(rank), rank)
        if len(chosen) < grid.positions:
            return None
        step = newest_common_step((held["own"] for held in self._available(chosen.values()).values()), up_to)
        if step is None:
            return None
        kept = {pos: self.workers[rank].kept_snapshot.remote(step) for pos, rank in chosen.items()}
        ready, _ = ray.wait(list(kept.values()), num_returns=len(kept),  # in hand before the survivors are stopped
                            timeout=5 * self.spec.fault_tolerance.heartbeat_timeout_s)
        if len(ready) < len(kept):
            return None  # a survivor did not hand its snapshot over in time: the checkpoint it is
        return step, kept

    def restore_positions(self, step: int, kept: dict) -> int:
        """Every rank takes the snapshot of ``step`` kept for its model position; returns the step."""
        grid = self.spec.parallel.grid
        return self._each("restore_snapshot", per_rank={r: (step, kept[grid.position(r)])
                                                        for r in range(len(self.workers))})[0]

    def call(self, method: str, *args) -> list:
        return self._each(method, args)

    def stop(self) -> None:
        with contextlib.suppress(Exception):  # a rank that already died cannot shut down cleanly; it is killed below
            self._each("shutdown")
        for w in [*self.workers, *self._spares.values(), *self._agents.values()]:
            ray.kill(w)
        self._spares.clear()
