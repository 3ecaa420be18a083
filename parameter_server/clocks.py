"""``ClockKeeper``: per-stage clocks for asp/ssp, the SSP read gate, and the step budget replicas draw from.

Written here: no library offers bounded-staleness clocks. A *worker* is one
pipeline stage of one data-parallel replica (``stage * workers + replica``;
without a pipeline, one rank per replica as before). A worker at clock c (it
has pushed c updates) may start its next step only once the slowest worker of
*its own stage* has reached c - staleness (``asp``: no bound): each stage's
keys live on their own clocks.

The stages of one replica are synchronous within a step (the pipeline
schedule's p2p pairs them), so replicas, not stages, are what drift. Steps are
therefore granted per replica: the first of a replica's stages to ask for its
step c takes it from one budget, ``steps * replicas`` for the whole run (the
run consumes the same samples as BSP whoever computes them), and every other
stage of that replica is given the same step, so a pipeline never has one
stage running a step its peer was refused. A replica step is complete once
each of its stages has ticked; the controller's step r is over once
``r * replicas`` replica steps have completed. ``pause`` stops new grants and
waits for the granted steps, so the controller can snapshot or restart a
shard on a quiet server.

A replica that loses a rank mid-step never completes that step, nor does one
whose surviving stage's step failed with it (``give_up``):
``hand_over`` gives it back to the budget, sets every stage of the replica back
to the steps all its stages completed (so they redo the step together; the
shards acknowledge a push they applied already without applying it twice), and
ends this *generation* (every free-running loop and every controller round
started under it), so the group can be re-formed and each worker, a
replacement included, rejoins at its clock. The replica's clocks stay where
they are meanwhile, so under SSP the others wait for it within the bound.
"""

from __future__ import annotations

import threading

WAIT_S = 600.0
LOST = "a peer worker was lost; the group is re-formed and every worker rejoins at its clock"


class ClockKeeper:
    def __init__(self, replicas: int, staleness: int | None, steps: int, stages: int = 1):
        self.replicas, self.stages = replicas, stages
        self.clocks = [0] * (replicas * stages)  # per worker: stage * replicas + replica
        self.staleness = staleness  # None: asp
        self.budget = steps * replicas
        self.granted = [0] * replicas  # replica steps handed out, per replica (steps 0 .. granted-1)
        self.base = [0] * replicas  # replica steps complete at the last restore
        self.order: list[int] = []  # replicas in the order their steps completed since then
        self.paused = False
        self.losses: list[float | None] = [None] * len(self.clocks)  # each worker's latest, again after a rejoin
        self.generation = 0  # bumped by ``hand_over``: the loops and rounds of an older one end
        self.handed: dict[int, int] = {}  # replica -> the generation its latest hand-over started
        self.abandoned: set[int] = set()  # surviving replicas a hand-over left with a step one stage never began
        self.cond = threading.Condition()

    @property
    def started(self) -> int:
        return sum(self.granted)

    @property
    def completed(self) -> int:
        return sum(self.base) + len(self.order)

    def _wait(self, predicate, what: str) -> None:
        if not self.cond.wait_for(predicate, timeout=WAIT_S):
            raise TimeoutError(f"clock keeper waited {WAIT_S:.0f}s for {what}")

    def _check(self, worker: int) -> None:
        if not 0 <= worker < len(self.clocks):
            raise ValueError(f"clock keeper: worker {worker}, but the job's workers are 0 to {len(self.clocks) - 1} "
                             f"({self.stages} stage(s) x {self.replicas} replica(s))")

    def _stage_clocks(self, worker: int) -> list[int]:
        first = worker - worker % self.replicas
        return self.clocks[first:first + self.replicas]

    def _within_bound(self, worker: int) -> bool:
        """The stage's slowest worker is at most ``staleness`` clocks behind ``worker``'s next step."""
        return self.staleness is None or min(self._stage_clocks(worker)) >= self.clocks[worker] - self.staleness

    def _replica_done(self, replica: int) -> int:
        """Steps of ``replica`` every stage has ticked."""
        return min(self.clocks[s * self.replicas + replica] for s in range(self.stages))

    def enter(self, worker: int, generation: int = 0) -> bool:
        """Start ``worker``'s next step once its stage's staleness bound allows; False: the budget is spent
        (the same answer for every stage of the replica), or ``generation`` (the caller's loop's) was ended by
        ``hand_over``."""
        with self.cond:
            self._check(worker)
            replica, step = worker % self.replicas, self.clocks[worker]
            what = f"worker {worker} at clock {step} to be within its stage's staleness bound"
            # paused, even a replica whose budget is spent waits: its last pull must not meet a shard restart
            # or a resize half done; a step a peer stage already took is never held (that could deadlock)
            self._wait(lambda: generation != self.generation or step < self.granted[replica]
                       or (not self.paused and (self.started >= self.budget or self._within_bound(worker))), what)
            if generation == self.generation and step >= self.granted[replica]:
                if self.started >= self.budget:
                    return False
                self.granted[replica] = step + 1
            # a step a peer stage took: this stage's bound, unless ``hand_over`` ends the generation first (the
            # bound may be waiting on the lost replica)
            self._wait(lambda: generation != self.generation or self._within_bound(worker), what)
            if generation == self.generation:
                return True
            if step < self.granted[replica]:  # granted, never begun here: the replica's step is abandoned half done
                self.abandoned.add(replica)
                self.cond.notify_all()
            return False

    def tick(self, worker: int, loss: float | None = None, generation: int | None = None) -> int:
        """``worker`` finished a step (its push is acknowledged by every holder) with ``loss`` (None off the last
        stage); returns its clock. A step begun under ``generation`` by a replica handed over since is not
        counted (a surviving stage finishing late): it was given back, and the replica's stages do it again."""
        with self.cond:
            self._check(worker)
            replica = worker % self.replicas
            if generation is not None and self.handed.get(replica, -1) > generation:
                return self.clocks[worker]
            self.losses[worker] = loss
            before = self._replica_done(replica)
            self.clocks[worker] += 1
            if self._replica_done(replica) > before:
                self.order.append(replica)
            self.cond.notify_all()
            return self.clocks[worker]

    def wait_completed(self, steps: int, worker: int | None = None, generation: int = 0) -> int:
        """Block until ``steps`` replica steps have completed in total (the end of a controller step); returns how
        many of them were ``worker``'s replica's (all of them when None), so each stage reports the same steps.
        A ``hand_over`` meanwhile ends the wait with an error (the round is abandoned with the lost replica)."""
        with self.cond:
            self._wait(lambda: self.completed >= steps or generation != self.generation,
                       f"{steps} completed replica steps")
            if generation != self.generation:
                raise RuntimeError(f"round abandoned at {self.completed} of {steps} replica steps: {LOST}")
            if worker is None:
                return steps
            replica = worker % self.replicas
            return self.base[replica] + self.order[:steps - sum(self.base)].count(replica)

    def hand_over(self, lost: list[int]) -> dict:
        """Replicas ``lost`` lost a rank: their steps in flight go back to the budget and each of their stages is
        set back to the steps the whole replica completed (a replacement does the step again with its peers, at
        the same clock), this generation's loops and rounds end, and no step starts until ``resume``. Returns
        once the survivors' steps in flight are done, with the state to rejoin from."""
        with self.cond:
            self.paused = True
            self.generation += 1
            self._set_back(lost)
            self.cond.notify_all()
            self._wait(lambda: all(self.granted[r] == self._replica_done(r) or r in self.abandoned
                                   for r in range(self.replicas)), "the survivors' steps in flight")
            self._set_back(sorted(self.abandoned))  # a stage of theirs never began the step: they redo it too
            self.abandoned.clear()
            return self._state()

    def give_up(self, worker: int) -> None:
        """``worker``'s loop ended in an error mid-step (a shard call or a pipeline transfer failed): it will
        never tick the step its replica was granted, so that step is abandoned as one a stage never began is.
        A ``hand_over`` (now, or the one the error leads to) then does not wait for it, and the replica's stages
        redo it together once the group is re-formed."""
        with self.cond:
            self._check(worker)
            replica = worker % self.replicas
            if self.clocks[worker] < self.granted[replica]:
                self.abandoned.add(replica)
                self.cond.notify_all()

    def _set_back(self, replicas: list[int]) -> None:
        """Give ``replicas``' steps in flight back to the budget and set each of their stages to the steps the
        whole replica completed; a late tick from the ended generation is ignored (``tick``)."""
        for replica in replicas:
            done = self._replica_done(replica)
            self.granted[replica] = done
            for stage in range(self.stages):
                self.clocks[stage * self.replicas + replica] = done
            self.handed[replica] = self.generation

    def pause(self) -> None:
        with self.cond:
            self.paused = True
            self._wait(lambda: self.completed == self.started, "the steps in flight")

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def restore(self, clocks: list[int], completed: int) -> None:
        """Continue from a checkpoint (or a rollback): each worker at its clock, ``completed`` replica steps done
        (as ``state`` gave them); the budget stays the whole run's."""
        with self.cond:
            if len(clocks) != len(self.clocks):
                raise ValueError(f"clock keeper: restore of {len(clocks)} clocks, but the job has {len(self.clocks)} "
                                 f"workers ({self.stages} stage(s) x {self.replicas} replica(s))")
            self.clocks = list(clocks)
            self.base = [self._replica_done(r) for r in range(self.replicas)]
            if sum(self.base) != completed:
                raise ValueError(f"clock keeper: restore of {completed} completed replica steps, but the clocks "
                                 f"{clocks} complete {sum(self.base)}")
            self.granted = list(self.base)
            self.order = []
            self.paused = False
            self.cond.notify_all()

    def state(self) -> dict:
        with self.cond:
            return self._state()

    def _state(self) -> dict:
        return {"clocks": list(self.clocks), "started": self.started, "completed": self.completed,
                "generation": self.generation, "losses": list(self.losses)}
