"""Rank 0's desk: what its loop hands the controller, and what the controller asks of the loop.

The loop runs on the rank's main thread; the controller's calls (``items``, ``post``) arrive on another, so
everything here is guarded by one condition. Items are numbered: the controller asks for those after the last
number it holds (a long poll), so a lost or repeated call loses or repeats nothing, and items it has are dropped.
One desk per window: a window's id names it, so a late call about an earlier window cannot mix with this one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray

from workers.loop.plan import LoopFailed, Request


class Desk:
    def __init__(self, window_id: int = 0):
        self.window_id = window_id
        self._changed = threading.Condition()
        self._items: list[Any] = []
        self._first = 0  # the number of _items[0]
        self._requests: list[Request] = []
        self._stepping = 0  # the step the loop is in: a request posted now is taken at its boundary
        self._acked = 0  # how many items the controller holds: a poll asking from number n holds those before n

    def put(self, item: Any) -> None:
        with self._changed:
            self._items.append(item)
            self._changed.notify_all()

    def items(self, after: int, wait_s: float) -> tuple[list[Any], int]:
        """The items numbered ``after`` and on, waiting up to ``wait_s`` for one; and the number after them.
        Those before ``after`` are dropped: the caller has them (a reply can die with this process, so only the
        caller's next poll says it holds what the last one returned)."""
        deadline = time.monotonic() + wait_s
        with self._changed:
            del self._items[:max(0, after - self._first)]
            self._first = max(self._first, after)
            self._acked = max(self._acked, after)
            self._changed.notify_all()
            while not self._items and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
            return list(self._items), self._first + len(self._items)

    def wait_delivered(self, wait_s: float) -> bool:
        """Wait (up to ``wait_s``) until the controller holds every item put so far (its next poll says so: a
        reply returned is not a reply received, when the fault kills this process right after); whether it does.
        Before a step a drill's fault hits: should the fault kill rank 0, its desk dies with it, and the controller
        must know the step before it completed, or it would take the fault for unfired and fire it again."""
        deadline = time.monotonic() + wait_s
        with self._changed:
            while self._acked < self._first + len(self._items) and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
            return self._acked >= self._first + len(self._items)

    def stepping(self, step: int) -> None:
        with self._changed:
            self._stepping = step

    def post(self, request: Request) -> int:
        """Queue ``request`` for the boundary after the step in progress; returns that step (a stop ends the window
        there, faults hit the step after it)."""
        with self._changed:
            self._requests.append(request)
            return self._stepping

    def take(self, step: int) -> Request:
        """At ``step``'s boundary: every request posted since the last one, as one (a stop wins; faults in posting
        order; the drained ranks of all). From here on a request is the next step's."""
        with self._changed:
            requests, self._requests = self._requests, []
            self._stepping = step + 1
        stop = next((r.stop for r in requests if r.stop), None)
        return Request(stop=stop, faults=tuple(f for r in requests for f in r.faults),
                       preempted=tuple(sorted({rank for r in requests for rank in r.preempted})))


class DeskHolder:
    """What rank 0 answers the controller on while its loop runs (its actor's ``control`` concurrency group): the
    desk of each window, made by whichever comes first, the window or the controller's call. Mixed into the rank
    actor (``RankWorker``) and the simulator's virtual host, so both speak the same calls."""

    def _init_desk(self) -> None:
        self._desk = Desk(0)
        self._desk_lock = threading.Lock()

    def _desk_of(self, window_id: int) -> Desk:
        with self._desk_lock:
            if self._desk.window_id != window_id:
                self._desk = Desk(window_id)
            return self._desk

    @ray.method(concurrency_group="control")
    def desk_items(self, window_id: int, after: int, wait_s: float) -> tuple[list, int]:
        """The window's items from number ``after`` on, waiting up to ``wait_s`` for one (a long poll)."""
        return self._desk_of(window_id).items(after, wait_s)

    @ray.method(concurrency_group="control")
    def desk_post(self, window_id: int, request: Request) -> int:
        """A request for the window's next boundary; returns the step it is taken at."""
        return self._desk_of(window_id).post(request)

    @ray.method(concurrency_group="control")
    def desk_put(self, window_id: int, notice: tuple) -> None:
        """A node agent saw a rank's loop end in a failure of its own (``NodeAgent.start``)."""
        _, rank, how = notice
        self._desk_of(window_id).put(LoopFailed(-1, f"rank {rank} {how}"))
