"""``NodeAgent``: one actor per node that carries the controller's calls to every rank on its node.

Why: a call that must reach every rank (forming the group, starting a window, a rollback, a checkpoint load)
would cost the controller one Ray call per rank, 16,384 at the scale the planner plans for; through the agents
it makes one per node, and each agent makes one per local rank, beside the others. An agent knows how each of
its ranks answered (a value, an error of the rank's own, a dead actor, no answer in time), so the controller
learns which ranks failed a call without a call of its own to each. Torch-free: a process of its own that starts
in a second, apart from the ranks.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from workers.diagnostics import stacks

# how a rank answered: ("ok", value), ("died", None), ("hung", None), ("raised", the RayTaskError)
Answer = tuple[str, Any]
POLL_S = 0.05  # how often ``where`` looks again at the calls not answered yet and at their processes' state


class NodeAgent:
    def __init__(self) -> None:
        self.workers: dict[int, Any] = {}  # rank -> its RankWorker actor on this node
        self.started: dict[int, Any] = {}  # rank -> its call started by ``start`` (a window's loop)
        self.identities: dict[int, Any] = {}  # rank -> its ``identity`` call (its pid), asked when adopted

    def adopt(self, workers: dict[int, Any]) -> None:
        """These ranks live on this node now (a formation, a replacement); ranks given as None left it."""
        for rank, worker in workers.items():
            if worker is None:
                self.workers.pop(rank, None)
                self.identities.pop(rank, None)
            else:
                self.workers[rank] = worker
                self.identities[rank] = worker.identity.remote()  # not waited for: answered once it started

    def kill(self, ranks: list[int]) -> list[int]:
        """SIGKILL these local ranks' processes; returns those killed. Why not ``ray.kill`` alone: it asks the
        actor's own process to exit, which a frozen one (stopped, or stuck where Python never runs) never does,
        and its peers then wait in their collectives for it until their timeout; the kernel's kill is heard."""
        killed = []
        for rank, pid in self._pids(ranks).items():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # already gone
            killed.append(rank)
        return killed

    def stacks(self, wait_s: float) -> dict[int, str]:
        """Every thread's Python stack of each of its ranks, frozen ones too (``workers.diagnostics.stacks``):
        what a hang's diagnosis keeps of where each rank was, before the stuck ones are killed."""
        return stacks.dump(self._pids(list(self.workers)), wait_s)

    def _pids(self, ranks: list[int]) -> dict[int, int]:
        """The process of each of ``ranks`` that started on this node (rank -> pid)."""
        pids = {}
        for rank in ranks:
            try:
                pids[rank] = ray.get(self.identities[rank], timeout=0)["pid"]
            except (KeyError, GetTimeoutError, RayActorError, RayTaskError):
                continue  # never started, or not this node's
        return pids

    def call(self, method: str, args: tuple = (), per_rank: dict[int, tuple] | None = None,
             timeout_s: float | None = None) -> dict[int, Answer]:
        """``method`` on each of its ranks (``per_rank``: those ranks, each with its own arguments; else all, with
        ``args``), answered within ``timeout_s``."""
        calls = {r: getattr(self.workers[r], method).remote(*(per_rank[r] if per_rank is not None else args))
                 for r in (per_rank if per_rank is not None else self.workers)}
        ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout_s)
        return {r: _answer(ref) for r, ref in calls.items()}

    def where(self, wait_s: float) -> dict[int, Answer]:
        """Each of its ranks' ``progress`` (where its loop is), waiting up to ``wait_s`` for the answers, but not
        for a rank whose process is stopped (SIGSTOP): it answers nothing until continued, and waiting out
        ``wait_s`` for it only delayed a frozen rank's diagnosis by that long (it stays ``hung``)."""
        calls = {r: w.progress.remote() for r, w in self.workers.items()}
        wait_unless_stopped(calls, self._pids(list(calls)), wait_s, lambda ref: bool(ray.wait([ref], timeout=0)[0]))
        return {r: _answer(ref) for r, ref in calls.items()}

    def start(self, method: str, args: tuple = (), notify=None) -> None:
        """``method`` on every rank, not waited for (``outcomes`` says how each ended). ``notify``: (an actor, the
        window id) whose ``desk_put`` hears at once when one of them ends other than normally: a rank that died
        (its peers in an NCCL collective would not notice before NCCL's timeout) or failed on its own."""
        self.started = {r: getattr(w, method).remote(*args) for r, w in self.workers.items()}
        if notify is not None:
            threading.Thread(target=self._watch, args=(dict(self.started), *notify), daemon=True).start()

    @staticmethod
    def _watch(started: dict[int, Any], desk, window_id: int) -> None:
        """Tell ``desk`` of the first of ``started`` to end in a failure of its own (a peer's is not news)."""
        pending = list(started.values())
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            rank = next(r for r, ref in started.items() if ref == ready[0])
            how, value = _answer(ready[0])
            if how == "died" or (how == "raised" and getattr(getattr(value, "cause", None), "kind", "") != "peer_lost"):
                desk.desk_put.remote(window_id, ("rank_failed", rank, how))
                return

    def outcomes(self, wait_s: float, ranks: list[int] | None = None) -> dict[int, Answer]:
        """How the started calls of ``ranks`` (default all) ended, waiting up to ``wait_s`` for them; a call not
        over by then is ``hung``."""
        calls = {r: ref for r, ref in self.started.items() if ranks is None or r in ranks}
        ray.wait(list(calls.values()), num_returns=len(calls), timeout=wait_s)
        return {r: _answer(ref) for r, ref in calls.items()}


def wait_unless_stopped(calls: dict[int, Any], pids: dict[int, int], wait_s: float, done: Callable[[Any], bool],
                        sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait up to ``wait_s`` until each call of ``calls`` (rank -> its call) is ``done``, or its rank's process
    (``pids``) is stopped."""
    deadline = time.monotonic() + wait_s
    pending = dict(calls)
    while True:
        pending = {r: c for r, c in pending.items() if not done(c) and not stacks.stopped(pids.get(r))}
        left = deadline - time.monotonic()
        if not pending or left <= 0:
            return
        sleep(min(left, POLL_S))


def _answer(ref) -> Answer:
    try:
        return "ok", ray.get(ref, timeout=0)
    except RayActorError:
        return "died", None
    except GetTimeoutError:
        return "hung", None
    except RayTaskError as exc:
        return "raised", exc
