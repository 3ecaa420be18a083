"""One rank's in-memory snapshots, with the replica to its peer shipped off the training critical path.

At a snapshot step the rank copies its state to host memory right after the
step (``workers.state.snapshot.take``: a memcpy, consistent with that step) and
queues it; a background thread ships queued snapshots, in step order, to the
holder rank's actor while the next steps run, and remembers the newest step
the holder acknowledged. So a rank holds its own snapshots of several recent
steps and, for the rank it holds replicas of, every acknowledged step: a
replica still in flight when its sender died was never acknowledged nor
stored, and recovery (``orchestrator.recovery.snapshot_target``) picks the newest step
that is complete on every side, never a torn one. Entries older than the step
every rank has replicated (``keep_from``, from the controller) are dropped.

Written here because Ray's object store drops an object with its owner: the
replica must be a plain copy in the holder's memory to outlive the sender.
"""

from __future__ import annotations

import logging
import queue
import threading

import ray

log = logging.getLogger(__name__)


class SnapshotStore:
    def __init__(self, rank: int):
        self.rank = rank
        self.own: dict[int, dict] = {}  # step -> this rank's snapshot
        self.replicas: dict[int, dict[int, dict]] = {}  # rank -> step -> that rank's snapshot held here
        self.holder = None  # the actor keeping this rank's replicas; None in a one-rank job or a mirror (zero 0)
        self.replicated = -1  # the newest step the holder acknowledged
        self._lock = threading.Lock()  # replicas arrive on the replica thread while training prunes them
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._ship_forever, name="snapshot-shipper", daemon=True).start()

    def keep(self, step: int, snap: dict, keep_from: int = -1) -> None:
        """Keep ``snap`` of ``step`` and queue its replica; drop what every rank has replicated past."""
        self.own[step] = snap
        if self.holder is None:
            self.replicated = step  # nothing to ship: a one-rank job has one copy, a mirror's holder has its own
        else:
            self._queue.put((self.holder, step, snap))
        self._keep_only(lambda s: s >= keep_from)

    def hold(self, rank: int, step: int, snap: dict) -> None:
        """Store a peer's replica (runs on the actor's replica thread, beside training)."""
        with self._lock:
            self.replicas.setdefault(rank, {})[step] = snap

    def settle(self) -> dict:
        """Wait until nothing is in flight, then say which steps are complete here (for a recovery)."""
        self._queue.join()
        with self._lock:
            return {"own": sorted(self.own), "replicas": {r: sorted(held) for r, held in self.replicas.items()}}

    def roll_back(self, step: int) -> None:
        """After a rollback to ``step`` the later snapshots belong to steps that never happened."""
        self._queue.join()  # none of them may land after this
        self._keep_only(lambda s: s <= step)
        self.replicated = min(self.replicated, step)

    def _keep_only(self, wanted) -> None:
        with self._lock:
            self.own = {s: v for s, v in self.own.items() if wanted(s)}
            self.replicas = {r: {s: v for s, v in held.items() if wanted(s)} for r, held in self.replicas.items()}

    def _ship_forever(self) -> None:
        while True:
            holder, step, snap = self._queue.get()
            try:
                ray.get(holder.hold_replica.remote(self.rank, step, snap))
                self.replicated = max(self.replicated, step)
            except ray.exceptions.RayError as exc:  # the holder died: its replacement gets the recovery's snapshot
                log.warning("rank %d: replica of step %d not stored: %s", self.rank, step, type(exc).__name__)
            finally:
                self._queue.task_done()
