"""The rank actors of one job: start them, run a step on all, and replace the ones that fail.

A step either completes on every rank or raises ``StepFailed`` naming the
ranks that died (actor or process gone) or hung (no answer within the
heartbeat timeout; those are killed so they count as dead). Survivors blocked
in a collective with a dead peer get an error from gloo/NCCL within the
collective timeout, so a failed step always ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError

from orchestrator.placement import RankPlacement
from orchestrator.spec import JobSpec
from workers.layout import coordinates
from workers.rank_worker import RankWorker


@dataclass
class StepFailed(Exception):
    """A step that did not complete on every rank, and why: ``kind`` is ``rank``, ``hang`` or ``nan_loss``."""

    dead: dict[int, str]  # rank -> "died" | "hung"
    kind: str = ""

    def __post_init__(self) -> None:
        self.kind = self.kind or ("hang" if "hung" in self.dead.values() else "rank")

    def __str__(self) -> str:
        return ", ".join(f"rank {r} {how}" for r, how in sorted(self.dead.items())) or self.kind


class RankGroup:
    worker_extra: dict = {}  # extra keys for the workers' spec dict (``ps_routes`` under dp_sync: ps)

    def __init__(self, spec: JobSpec, placement: RankPlacement, use_gpu: bool):
        self.spec = spec
        self.placement = placement
        self.use_gpu = use_gpu
        self.workers: list = [self._new_actor(r) for r in range(spec.parallel.world_size)]

    def _new_actor(self, rank: int):
        p = self.spec.parallel
        return ray.remote(RankWorker).options(
            num_cpus=p.cpus_per_rank,
            num_gpus=1 if self.use_gpu else 0,
            scheduling_strategy=self.placement.strategy(rank),
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
            name=f"{self.spec.name}-rank{rank}-{time.time_ns()}",
        ).remote()

    def form(self) -> list[dict]:
        """(Re)join every rank into a fresh process group and build its model; returns each rank's info."""
        world = self.spec.parallel.world_size
        ray.get([w.preload.remote() for w in self.workers])  # survivors return at once; new actors import first
        addr, port = ray.get(self.workers[0].rendezvous_address.remote())
        worker_spec = {**self.spec.worker_dict(), **self.worker_extra}
        return ray.get([w.setup.remote(worker_spec, r, world, addr, port) for r, w in enumerate(self.workers)])

    def step(self, faults: dict[int, dict]) -> list[dict]:
        refs = [w.train_step.remote(faults.get(r)) for r, w in enumerate(self.workers)]
        ray.wait(refs, num_returns=len(refs), timeout=self.spec.fault_tolerance.heartbeat_timeout_s)
        results, dead, errors = [], {}, []
        for rank, ref in enumerate(refs):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                dead[rank] = "hung"
                continue
            try:
                results.append(ray.get(ref))
            except RayActorError:
                dead[rank] = "died"
            except ray.exceptions.RayTaskError as exc:
                errors.append(exc)  # a survivor whose collective broke with the dead peer, or a real bug
        if errors and not dead:
            raise errors[0]  # every rank alive yet one raised: a bug to report, not a fault to recover from
        if dead:
            failure = StepFailed(dead)
            for rank in dead:
                ray.kill(self.workers[rank], no_restart=True)
            ray.wait(refs, num_returns=len(refs), timeout=self.spec.fault_tolerance.collective_timeout_s + 5)
            raise failure
        return results

    def replace(self, ranks) -> None:
        """New actors in the dead ranks' grid positions (their placement bundles are free again)."""
        for rank in ranks:
            self.workers[rank] = self._new_actor(rank)

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
        return not pending

    def holder(self, rank: int) -> int | None:
        """Where rank's replica lives: the same position in the next data-parallel replica (another node
        when replicas span nodes), else the next rank."""
        p = self.spec.parallel
        world = p.world_size
        if world == 1:
            return None
        step = p.pp * p.tp if p.dp > 1 else 1
        return (rank + step) % world

    def snapshot(self) -> None:
        """Every rank keeps its state in memory and hands a replica to its holder (calls stay ordered per actor)."""
        refs = [w.take_snapshot.remote() for w in self.workers]
        for rank, ref in enumerate(refs):
            holder = self.holder(rank)
            if holder is not None:
                self.workers[holder].hold_replica.remote(rank, ref)

    def restore(self, replaced: set[int]) -> int:
        """Roll every rank back to the last snapshot; replaced ranks take their replica. Returns the step."""
        for rank in replaced:
            holder = self.holder(rank)
            if holder is None or holder in replaced:
                raise LookupError(f"the in-memory replica of rank {rank} died with it")
        calls = []
        for rank, w in enumerate(self.workers):
            snap = self.workers[self.holder(rank)].replica.remote(rank) if rank in replaced else None
            calls.append(w.restore_snapshot.remote(snap))
        steps = ray.get(calls)
        return steps[0]

    def survivor_snapshots(self, dead: set[int]) -> dict | None:
        """(pp, tp) position -> a surviving rank's last snapshot, for a grid with another dp to start from.

        Only where data-parallel replicas are full copies (zero 0): ZeRO splits the state over dp,
        which only a DCP checkpoint can reshard. None also when every replica of a position died.
        """
        p = self.spec.parallel
        if p.zero != 0:
            return None
        kept = {}
        for rank, worker in enumerate(self.workers):
            c = coordinates(rank, p.dp, p.pp, p.tp)
            if rank not in dead and (c.pp, c.tp) not in kept:
                kept[(c.pp, c.tp)] = worker.kept_snapshot.remote()
        if len(kept) < p.pp * p.tp:
            return None
        ray.wait(list(kept.values()), num_returns=len(kept))  # in hand before the survivors are stopped
        return kept

    def restore_positions(self, kept: dict) -> int:
        """Every rank takes the snapshot kept for its (pp, tp) position; returns the step."""
        p = self.spec.parallel
        coords = [coordinates(r, p.dp, p.pp, p.tp) for r in range(p.world_size)]
        return ray.get([w.restore_snapshot.remote(kept[(c.pp, c.tp)]) for w, c in zip(self.workers, coords)])[0]

    def call(self, method: str, *args) -> list:
        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def stop(self) -> None:
        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        except Exception:  # a rank that already died cannot shut down cleanly; it is killed below
            pass
        for w in self.workers:
            ray.kill(w)
