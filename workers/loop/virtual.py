"""Virtual ranks for the scale simulator: many ranks per process, no torch, behind the same loop and Ray calls.

A ``VirtualHost`` actor steps a block of ranks as one participant of ``RankLoop``: each step sleeps a set time
and reports one record per rank, merged in the process; the hosts exchange their summaries up the same tree the
real ranks use, over Ray messages between the host processes (``RayTransport``), so the real controller, its
policies and its Ray calls run a 16,384-rank job on a two-core machine (``orchestrator/runtime/simulated.py``,
``benchmarks/control_plane.py``). A rank killed on command (a ``kill_rank`` fault reaching it through the window)
dies as a real one does: its host's loop fails, the host leaves the exchange (its tree neighbours fail at once,
as gloo peers of a dead rank do), and the controller learns which rank died from the host's outcome.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import ray

from workers.loop.desk import DeskHolder
from workers.loop.loop import RankLoop
from workers.loop.plan import Window, WindowEnd
from workers.loop.summary import SaveState, StepSummary
from workers.loop.tree import TreeExchange
from workers.protocol import RankInfo, StepResult, StepTimes

LEFT = "left"  # what a host that failed sends its tree neighbours (a dead rank's closed sockets)


class PeerLeft(RuntimeError):
    """A tree neighbour left the exchange: the step failed elsewhere (the host is a survivor)."""


class RanksDied(RuntimeError):
    """Ranks of this host died in their step (a ``kill_rank`` fault): rank -> how."""

    def __init__(self, dead: dict[int, str]):
        super().__init__(f"ranks {sorted(dead)} died")
        self.dead = dead


class RayTransport:
    """Messages between host actors: ``deliver`` calls on the receiver, queued per sender (one mail thread keeps
    each sender's order). Each carries its window's id: mail of an earlier window (a neighbour's ``LEFT`` still
    on its way when the group was formed again) is dropped."""

    def __init__(self, me: int, hosts: list):
        self.me, self.hosts = me, hosts
        self.window = 0
        self.boxes: dict[tuple[int, int], queue.Queue] = {}  # (window, sender) -> its messages
        self._lock = threading.Lock()

    def open(self, window_id: int) -> None:
        """This host runs window ``window_id`` now (a neighbour may have sent to it already)."""
        with self._lock:
            self.window = window_id
            self.boxes = {key: box for key, box in self.boxes.items() if key[0] >= window_id}

    def _box(self, window_id: int, source: int) -> queue.Queue:
        with self._lock:
            return self.boxes.setdefault((window_id, source), queue.Queue())

    def send(self, obj: Any, to: int) -> None:
        self.hosts[to].deliver.remote(self.me, self.window, obj)

    def recv(self, source: int) -> Any:
        obj = self._box(self.window, source).get()
        if isinstance(obj, str) and obj == LEFT:
            raise PeerLeft(f"host {source} left the exchange")
        return obj

    def arrive(self, source: int, window_id: int, obj: Any) -> None:
        if window_id >= self.window:  # mail of an earlier window is stale
            self._box(window_id, source).put(obj)

    def leave(self, neighbours) -> None:
        for host in neighbours:
            self.hosts[host].deliver.remote(self.me, self.window, LEFT)


class VirtualRanks:
    """A block of ranks that step by sleeping (the loop's ``Stepper``): every rank of the block reports the same
    record but for its rank; snapshots and checkpoints are steps remembered, no state."""

    def __init__(self, ranks: range, step_s: float):
        self.ranks, self.step_s = ranks, step_s
        self.step = 0
        self.snapshots: set[int] = set()
        self.died_at: float | None = None  # when a rank of the block was killed (the benchmark's clock starts)

    def run_step(self, faults: dict[int, dict], detail: bool) -> StepSummary:
        dead = {r: "died" for r, f in faults.items() if r in self.ranks and f["kind"] in ("kill_rank", "kill_node")}
        if dead:
            self.died_at = time.time()
            raise RanksDied(dead)
        t0 = time.perf_counter()
        self.step += 1
        times = StepTimes(compute=self.step_s, step=self.step_s)
        results = [StepResult(rank=r, step=self.step, loss=1.0 / self.step, grad_norm=1.0, lr=1e-3, tokens=0,
                              applied=True, time_s=times, peak_memory_bytes=1 << 30, current_memory_bytes=1 << 29,
                              replicated_step=self.step) for r in self.ranks]
        summary = StepSummary.of_all(results, detail)  # the block's records, merged as its ranks' step runs
        time.sleep(max(0.0, self.step_s - (time.perf_counter() - t0)))
        return summary

    def skip_batch(self) -> None: ...

    def snapshot(self, keep_from: int) -> None:
        self.snapshots = {s for s in self.snapshots if s >= keep_from} | {self.step}

    def save(self, path: str, async_save: bool, dir_mode: int | None) -> str | None:
        return None

    def save_state(self) -> SaveState | None:
        return None

    def finish_save(self) -> SaveState | None:
        return None


class VirtualHost(DeskHolder):
    """A process hosting ``ranks`` virtual ranks (the Ray actor class; ``simulated.SimGroup`` starts them)."""

    def __init__(self, index: int, ranks: range, step_s: float):
        self.index, self.ranks = index, ranks
        self.stepper = VirtualRanks(ranks, step_s)
        self.transport: RayTransport | None = None
        self.exchange: TreeExchange | None = None
        self._init_desk()
        self.outcome: dict[int, str] = {}  # rank -> how the last window ended for it, when it failed

    def connect(self, hosts: list) -> None:
        self.transport = RayTransport(self.index, hosts)
        self.exchange = TreeExchange(self.index, len(hosts), self.transport)

    def infos(self) -> list[RankInfo]:
        """What each of its ranks reports once formed (coordinates are the controller's: dp only here)."""
        ctx = ray.get_runtime_context()
        return [RankInfo(rank=r, coords={"dp": r}, stages=[0], device="cpu", device_name="virtual", pid=r,
                         node_id=ctx.get_node_id(), actor_id=ctx.get_actor_id()) for r in self.ranks]

    def form(self) -> int:
        """A new process group: the rank's state is lost unless restored (step 0), mail from before is gone."""
        self.stepper.step = 0
        self.outcome = {}
        return len(self.ranks)

    def run_window(self, window: Window, window_id: int) -> WindowEnd:
        desk = self._desk_of(window_id) if self.exchange.root else None
        self.transport.open(window_id)
        self.outcome = {}
        try:
            return RankLoop(self.stepper, self.exchange, desk).run(window)
        except RanksDied as died:
            self.outcome = {r: died.dead.get(r, "peer_lost") for r in self.ranks}
            self._leave()
            raise
        except PeerLeft:
            self.outcome = dict.fromkeys(self.ranks, "peer_lost")
            self._leave()
            raise

    def _leave(self) -> None:
        """Tell the tree neighbours this host left, so none waits for it (a dead rank's closed sockets)."""
        ex = self.exchange
        self.transport.leave([*([ex.parent] if ex.parent is not None else []), *ex.children])

    def window_outcome(self) -> dict[int, str]:
        """How the last window ended for each rank that did not end it normally (``died``, ``peer_lost``)."""
        return self.outcome

    def died_at(self) -> float | None:
        return self.stepper.died_at

    def restore(self, step: int) -> int:
        """Every rank back to ``step`` (its snapshot, or a replica: state is a step count here), at no cost."""
        self.stepper.step = step
        return step

    def snapshot_steps(self) -> list[int]:
        return sorted(self.stepper.snapshots)

    def take_snapshot(self, keep_from: int = -1) -> int:
        self.stepper.snapshot(keep_from)
        return self.stepper.step

    @ray.method(concurrency_group="mail")
    def deliver(self, source: int, window_id: int, obj: Any) -> None:
        self.transport.arrive(source, window_id, obj)
