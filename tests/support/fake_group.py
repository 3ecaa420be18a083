"""A fake ``Runtime`` and rank group: the controller's whole life in milliseconds, without Ray or torch.

The group's ranks are one participant of the real ``workers.loop.RankLoop``: the controller hands them windows
and reads rank 0's desk exactly as on Ray. The ranks keep one step counter for all, the steps they snapshotted
and the checkpoints they saved (a small file per checkpoint, so the real ``CheckpointDir`` seals and verifies
them). They honour the job's fault schedule the way the real ranks do (``kill_rank``/``kill_node`` die,
``hang_rank`` hangs, ``nan_loss`` returns NaN), and ``FakeRuntime.script`` runs a function before a given step
(to request a stop or a resize). The loop runs on its own thread in lockstep with the controller: each item it
hands over waits until the controller has taken it and asks again, so every test sees one interleaving. Knobs on
the runtime decide what placement, snapshots and the elastic policy answer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import queue
import threading
from pathlib import Path

from orchestrator.recovery.elastic import resized
from orchestrator.runtime.group import PREEMPTED, StepFailed
from orchestrator.spec import JobSpec
from workers.loop.desk import Desk
from workers.loop.loop import RankLoop
from workers.loop.plan import LoopFailed, Request, Window, WindowEnd
from workers.loop.summary import SaveState, StepSummary
from workers.loop.tree import LocalTransport, TreeExchange
from workers.protocol import RankInfo, StepResult

# what the real group reports for each fault kind (``RankGroup``: raised steps via ``ranks_that_failed``)
_FAILS = {"hang_rank": "hung", "oom": "ran out of memory (MemoryError: injected)",
          "raise_error": "raised (InjectedError: injected)"}


class FakePlacement:
    def __init__(self) -> None:
        self.released = False

    def release(self) -> None:
        self.released = True


class FakeElastic:
    """``ElasticPolicy``'s answers without asking Ray: every smaller dp down to min_dp fits; ``grow_to`` grows."""

    def __init__(self, spec: JobSpec):
        self.target_dp = spec.parallel.dp
        self.grow_to: int | None = None

    def shrink_options(self, spec: JobSpec, use_gpu: bool) -> list[JobSpec]:
        return [resized(spec, dp) for dp in range(spec.parallel.dp - 1, spec.fault_tolerance.min_dp - 1, -1)]

    def grow(self, spec: JobSpec, use_gpu: bool) -> JobSpec | None:
        dp, self.grow_to = self.grow_to, None
        return resized(spec, dp) if dp is not None else None


class FakeRuntime:
    """Knobs: ``placeable`` (replacements start), ``more_dead`` (found when the failed step ends),
    ``lose_snapshots`` (restore raises ``LookupError``), ``script`` (step -> function run before it),
    ``nan_batches`` (data that makes the loss NaN whenever it is trained on), ``fail_calls`` (a rank method ->
    the exceptions its next calls raise: a rank's error, or ``StepFailed`` for a rank lost; ``save_checkpoint``
    and ``wait_checkpoint`` are the ranks' saves and waits for an asynchronous save, in a window or called by the
    controller), ``held_out`` (step -> the held-out loss of a step that evaluates), ``stall`` (step -> a rank that
    freezes in it: no answer until the controller's progress deadline calls it hung), ``preempt`` (step -> a rank
    whose process has a preemption notice during it), ``ready_after`` (``recovery: keep_training``: how many times
    the controller asks whether the failed ranks' replacements are up before they are), ``draining_nodes`` (the
    nodes Ray would say are being drained, with their seconds to the deadline: rank r lives on ``node<r>`` until
    a drain moves it to ``node<r>b``)."""

    def __init__(self, placeable: bool = True, more_dead: dict[int, str] | None = None,
                 lose_snapshots: bool = False, script: dict | None = None, nan_batches: frozenset = frozenset(),
                 fail_calls: dict[str, list[Exception]] | None = None, held_out=lambda step: 2.0 / step,
                 stall: dict[int, int] | None = None, preempt: dict[int, int] | None = None, ready_after: int = 2):
        self.placeable = placeable
        self.ready_after = ready_after
        self.preempt = dict(preempt or {})  # step -> a rank told to go (SIGTERM) during it
        self.stall = dict(stall or {})  # step -> a rank that freezes in it (no error, no progress)
        self.held_out = held_out  # step -> the held-out loss a step that evaluates reports
        self.more_dead = dict(more_dead or {})
        self.lose_snapshots = lose_snapshots
        self.script = dict(script or {})
        self.nan_batches = nan_batches  # batches whose loss is NaN every time they are trained on
        self.fail_calls = {k: list(v) for k, v in (fail_calls or {}).items()}  # method -> what its next calls raise
        self.groups: list[FakeGroup] = []
        self.placements: list[FakePlacement] = []
        self.elastic_policy: FakeElastic | None = None
        self.draining_nodes: dict[str, float | None] = {}
        self.moved: set[int] = set()  # ranks a drain moved to another node

    def preflight(self, spec: JobSpec) -> None: ...
    def connect(self, address: str | None, needed_cpus: float) -> None: ...
    def check_job_faults(self, faults: list[dict], placement) -> None: ...

    def available(self) -> tuple[float, float]:
        return 64.0, 0.0

    def reserve(self, spec: JobSpec, use_gpu: bool, timeout_s: float) -> FakePlacement:
        self.placements.append(FakePlacement())
        return self.placements[-1]

    def start_group(self, spec: JobSpec, placement, use_gpu: bool) -> FakeGroup:
        self.groups.append(FakeGroup(self, spec))
        return self.groups[-1]

    def kill_node_refusal(self, rank: int, node_id: str) -> str | None:
        return None

    def nodes_gone(self, node_ids) -> set[str]:
        return set()

    def draining(self, node_ids) -> dict[str, float | None]:
        return {node: left for node, left in self.draining_nodes.items() if node in set(node_ids)}

    def elastic(self, spec: JobSpec) -> FakeElastic:
        self.elastic_policy = FakeElastic(spec)
        return self.elastic_policy

    def serve_control(self, job) -> None:
        return None


class LockstepDesk(Desk):
    """Rank 0's desk, handing each item over only when the controller asks for more: the loop thread waits at
    every item until the controller has taken it and asks again, so the two threads take turns. The window's end
    (and a failure) are handed over without waiting: the loop is over then."""

    def __init__(self, window_id: int = 0):
        super().__init__(window_id)
        self._queue: queue.Queue = queue.Queue()
        self._taken = threading.Semaphore(0)
        self._owed = False  # the loop waits for the controller to be done with the item it holds

    def put(self, item) -> None:
        self._queue.put(item)
        if not isinstance(item, WindowEnd | LoopFailed | _Failed):
            self._taken.acquire()

    def wait_delivered(self, wait_s: float) -> bool:
        return True  # in lockstep every item was taken before the loop goes on

    def next(self, wait_s: float | None = None):
        """The loop's next item, or None when none came within ``wait_s`` (the loop is stalled)."""
        if self._owed:
            self._taken.release()
            self._owed = False
        try:
            item = self._queue.get(timeout=wait_s)
        except queue.Empty:
            return None
        self._owed = True
        return item


class _Failed:
    """The window's loop raised (``error``): handed to the controller as the last item."""

    def __init__(self, error: BaseException):
        self.error = error


class FakeRanks:
    """Every rank of the fake group as one participant of the loop (``workers.loop.loop.Stepper``)."""

    def __init__(self, group: FakeGroup):
        self.group = group

    @property
    def step(self) -> int:
        return self.group.step_now

    def run_step(self, faults: dict[int, dict], detail: bool) -> StepSummary:
        return self.group.run_step(faults, detail)

    def skip_batch(self) -> None:
        self.group._skips_now += 1

    def snapshot(self, keep_from: int) -> None:
        self.group.snapshots.add(self.group.step_now)

    def save(self, path: str, async_save: bool, dir_mode: int | None) -> str | None:
        Path(path).mkdir(parents=True, exist_ok=True)  # as a real rank makes it before DCP writes
        if dir_mode is not None:
            Path(path).chmod(dir_mode)
        try:
            self.group.call("save_checkpoint", path, async_save)
        except StepFailed:
            raise
        except Exception as exc:  # what a rank's save raised, as the loop reports it (``TrainerStepper``)
            return f"rank 0: {(str(exc).strip().splitlines() or [type(exc).__name__])[0]}"
        return None

    def save_state(self) -> SaveState | None:
        step = getattr(self.group, "_in_flight", None)
        return None if step is None else SaveState(step, done=True)

    def finish_save(self) -> SaveState | None:
        step = getattr(self.group, "_in_flight", None)
        try:
            done = self.group.call("wait_checkpoint")[0]
        except StepFailed:
            raise
        except Exception as exc:
            return SaveState(step, done=True, error=f"rank 0: {(str(exc).strip().splitlines() or [''])[0]}")
        return None if done is None else SaveState(done, done=True)


class FakeGroup:
    def __init__(self, runtime: FakeRuntime, spec: JobSpec):
        self.runtime = runtime
        self.spec = spec
        self.world = spec.parallel.world_size
        self.worker_extra: dict = {}
        self.step_now = 0
        self.snapshots: set[int] = set()
        self.replaced: list[set[int]] = []
        self.live: list[int] | None = None  # keep_training: the ranks stepping without the failed replicas
        self.formed: list[tuple[str, int, list[int]]] = []  # (form | form_without, step, ranks) of each formation
        # rank -> trainers its current process built, and those its replaced processes built before it
        self.builds: dict[int, int] = {}
        self.builds_before: dict[int, int] = {}
        self._ready_asks = 0
        self.stopped = False
        self.skipped_at: dict[int, int] = {}  # step -> batches the ranks skipped before its latest run
        self._skips_now = 0  # skip_batch calls since the last step (a rank's data cursor, restored on rollback)
        self._desk: LockstepDesk | None = None
        self._thread: threading.Thread | None = None
        self._unstall = threading.Event()  # a stalled rank's step ends (FakeRuntime.stall)

    def _maybe_fail(self, method: str) -> None:
        pending = self.runtime.fail_calls.get(method)
        failure = pending.pop(0) if pending else None
        if failure is not None:
            raise failure

    def form(self, keep: bool = False) -> list[RankInfo]:
        """Every rank rebuilds its model: back to the initial state, step 0, until restored or loaded. ``keep``:
        only the ranks without a trainer (replacements) build one, as ``RankWorker.setup`` does."""
        self._maybe_fail("form")
        self.formed.append(("form", self.step_now, list(range(self.world))))
        self._build(r for r in range(self.world) if not keep or self.builds.get(r, 0) == 0)
        self.live = None
        self.step_now = 0
        self._in_flight = None  # an unfinished async save dies with the old process group
        grid = self.spec.parallel.grid
        return [RankInfo(rank=r, coords=grid.coords_dict(r), stages=[0], device="cpu", device_name="cpu", pid=1000 + r,
                         node_id=f"node{r}b" if r in self.runtime.moved else f"node{r}", actor_id=f"actor{r}")
                for r in grid.ranks()]

    def form_without(self, dead) -> list[RankInfo]:
        """The other ranks re-form without ``dead``, keeping their trainers (no build), restored next."""
        self._maybe_fail("form")
        self.live = [r for r in range(self.world) if r not in set(dead)]
        self.formed.append(("form_without", self.step_now, list(self.live)))
        self._ready_asks = 0
        self.step_now = 0
        return []

    def replacements_ready(self, ranks) -> bool:
        self._ready_asks += 1
        return self._ready_asks > self.runtime.ready_after

    # -- windows -------------------------------------------------------------------------------

    def start_window(self, window: Window, window_id: int = 0) -> None:
        self._desk = LockstepDesk(window_id)
        loop = RankLoop(FakeRanks(self), TreeExchange(0, 1, LocalTransport()), self._desk)
        self._thread = threading.Thread(target=self._run, args=(loop, window), daemon=True)
        self._thread.start()

    def _run(self, loop: RankLoop, window: Window) -> None:
        try:
            loop.run(window)
        except BaseException as exc:  # the controller raises it once it has taken everything before it
            self._desk.put(_Failed(exc))

    def window_items(self, wait_s: float | None = None) -> list:
        """The desk's next item (lockstep: one at a time), none while the loop is stalled (``FakeRuntime.stall``);
        raises the window's failure in its place."""
        item = self._desk.next(wait_s)
        if isinstance(item, _Failed):
            raise item.error
        return [] if item is None else [item]

    def window_hung(self, silent_s: float):
        """The controller found no progress: the stalled rank is hung (its step ends as the real one's killed)."""
        self.hung_after = silent_s
        self._unstall.set()
        while True:
            self.window_items(None)

    def preempted(self, ranks, leave: tuple[str, ...] = ()):
        """The preempted ranks go (the real group kills them) and are replaced as failed ones; those on the nodes
        it ``leave``s (being drained) come back on other nodes."""
        self.preempted_ranks = [*getattr(self, "preempted_ranks", []), *ranks]
        self.left = [*getattr(self, "left", []), leave]
        self.runtime.moved.update(r for r in ranks if f"node{r}" in leave)
        raise StepFailed(dict.fromkeys(ranks, PREEMPTED))

    def window_failed(self):
        """Rank 0's loop raised: the failure it raised (the fake's ranks raise the controller's ``StepFailed``)."""
        self.window_items(None)

    def post(self, request: Request) -> int | None:
        desk = self._desk
        if self.live is not None:  # the loop numbers the stepping ranks 0.. (``RankGroup._as_stepping``)
            request = dataclasses.replace(request, preempted=tuple(self.live.index(r) for r in request.preempted
                                                                   if r in self.live))
        return None if desk is None or not self._thread.is_alive() else desk.post(request)

    def run_step(self, faults: dict[int, dict], detail: bool = True) -> StepSummary:
        nxt = self.step_now + 1
        action = self.runtime.script.pop(nxt, None)
        if action is not None:
            action()
        stalled = self.runtime.stall.pop(nxt, None)
        if stalled is not None:  # frozen until the controller calls it hung
            self._unstall.clear()
            self._unstall.wait(60)
            raise StepFailed({stalled: "hung"})
        kinds = {rank: f["kind"] for rank, f in faults.items() if f["kind"] != "slow_rank"}
        self.skipped_at[nxt], self._skips_now = self._skips_now, 0
        batch = nxt + sum(n for s, n in self.skipped_at.items() if s <= nxt)  # batch n + the batches skipped
        if batch in self.runtime.nan_batches:
            kinds[0] = "nan_loss"
        dead = {r: _FAILS.get(k, "died") for r, k in kinds.items() if k != "nan_loss" and r in self._stepping}
        if dead:
            raise StepFailed(dead)
        self.step_now = nxt
        loss = math.nan if "nan_loss" in kinds.values() else 1.0 / nxt
        due = self.spec.eval.due(nxt, self.spec.train.steps)  # the ranks' rule: the section they parse it with
        held = self.runtime.held_out(nxt) if due else None
        told = self.runtime.preempt.pop(nxt, None)
        stepping = self.live if self.live is not None else range(self.world)  # the loop numbers them 0..
        summaries = [StepSummary.of(_result(i, nxt, loss, held), detail, preempted=r == told)
                     for i, r in enumerate(stepping)]
        merged = summaries[0]
        for summary in summaries[1:]:
            merged = merged.merge(summary)
        return dataclasses.replace(merged, saving=FakeRanks(self).save_state())

    @property
    def members(self) -> list[int]:
        """The grid ranks of the group that steps, in the loop's order (``RankGroup.members``)."""
        return list(self.live) if self.live is not None else list(range(self.world))

    @property
    def _stepping(self) -> set[int]:
        return set(self.live if self.live is not None else range(self.world))

    # -- between windows -----------------------------------------------------------------------

    def finish_failed_step(self) -> dict[int, str]:
        more, self.runtime.more_dead = self.runtime.more_dead, {}
        return more

    def replace(self, ranks) -> None:
        self.replaced.append(set(ranks))
        for rank in ranks:  # a new process: it has built no trainer yet
            self.builds_before[rank] = self.builds_before.get(rank, 0) + self.builds.pop(rank, 0)

    def prebuild(self, ranks) -> None:
        """``recovery: keep_training``: the replacements build their trainers while the others step (the rejoin's
        ``form(keep=True)`` then keeps them)."""
        self.prebuilt = [*getattr(self, "prebuilt", []), set(ranks)]
        self._build(ranks)

    def _build(self, ranks) -> None:
        for rank in ranks:
            self.builds[rank] = self.builds.get(rank, 0) + 1

    def trainer_builds(self) -> dict[int, int]:
        """Rank -> the trainers built in its grid position over the run (its replaced processes' included)."""
        return {r: self.builds.get(r, 0) + self.builds_before.get(r, 0) for r in range(self.world)}

    def start_spares(self) -> None: ...

    def placed(self, ranks, timeout_s: float) -> bool:
        return self.runtime.placeable

    def snapshot(self, keep_from: int = -1) -> None:
        self.snapshots.add(self.step_now)

    def restore(self, replaced: set[int], up_to: int) -> int:
        held = [s for s in self.snapshots if s <= up_to]
        if self.runtime.lose_snapshots or not held:
            raise LookupError(f"no snapshot step up to {up_to} is complete on every rank and replica")
        self.step_now = max(held)
        return self.step_now

    def survivor_snapshots(self, dead: set[int], up_to: int) -> tuple[int, dict] | None:
        held = [s for s in self.snapshots if s <= up_to]
        mirrored = self.spec.parallel.zero == 0 and self.spec.parallel.dp > 1
        return (max(held), {}) if mirrored and held else None

    def restore_positions(self, step: int, kept: dict) -> int:
        self.step_now = step
        return step

    def call(self, method: str, *args) -> list:
        if method == "wait_checkpoint" and (self.runtime.fail_calls.get(method) or [None])[0] is not None:
            self._in_flight = None  # a real rank's wait raises the failed save's error once and forgets it
        self._maybe_fail(method)
        return [getattr(self, f"_{method}")(*args)] * self.world

    def _save_checkpoint(self, path: str, async_save: bool) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        skipped = sum(n for s, n in self.skipped_at.items() if s <= self.step_now)  # in a real rank's data position
        (Path(path) / ".metadata").write_text(json.dumps({"step": self.step_now, "skipped": skipped}))  # DCP's file
        (Path(path) / "__0_0.distcp").write_bytes(bytes(64))  # a shard, for corrupt_checkpoint to damage
        self._in_flight = self.step_now if async_save else None

    def _skip_batch(self) -> None:
        self._skips_now += 1

    def _ps_resume(self, step: int | None = None) -> int:
        return self.step_now if step is None else step

    def _ps_reroute(self, shard: int, route: dict) -> None:
        self.rerouted = [*getattr(self, "rerouted", []), shard]

    def _ps_reshard(self, routes: list[dict]) -> None: ...

    def _checkpoint_durable(self) -> bool:
        return True

    def _wait_checkpoint(self) -> int | None:
        done, self._in_flight = getattr(self, "_in_flight", None), None
        return done

    def _load_checkpoint(self, path: str) -> int:
        saved = json.loads((Path(path) / ".metadata").read_text())
        self.step_now, self.skipped_at = saved["step"], {0: saved.get("skipped", 0)}  # the data position loaded
        return self.step_now

    def stop(self) -> None:
        self.stopped = True


def _result(rank: int, step: int, loss: float, eval_loss: float | None = None) -> StepResult:
    """One rank's step result (with ``eval_loss``, one of a step that evaluated)."""
    times = {"data": 0.001, "compute": 0.01, "bubble": 0.0, "communication": 0.001, "optimizer": 0.001,
             "step": 0.013}
    return StepResult.from_dict({"rank": rank, "step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens": 256,
            "applied": True, "time_s": times, "peak_memory_bytes": 1 << 20, "current_memory_bytes": 1 << 19,
            "replicated_step": step, **({} if eval_loss is None else {"eval_loss": eval_loss, "eval_s": 0.0})})
