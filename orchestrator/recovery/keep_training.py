"""``fault_tolerance.recovery: keep_training``: the other data-parallel replicas train on while a failed one is rebuilt
(torchft's quorum semantics, on plain data parallelism: ``orchestrator/spec/checks/recovery.py``).

Why: under the default every rank stops for every recovery (bit-identical, but the whole job pays each failure). Here
the survivors roll their failed step back to their own snapshot (at most that step is lost), re-form a process group
without the failed replicas and step on, each on the share of every global batch it read before
(``WorkerSpec.data_slot``): gradients are averaged over the survivors, and the failed replicas' shares of those steps
are skipped, never trained. The failed ranks' replacements start meanwhile; once every one is up, the window is
stopped at the next step boundary, the full group re-forms and the new ranks take a live peer's snapshot of that step
(the zero-0 mirror: ``RankGroup.restore``), so every replica holds the same weights and optimizer state again. The
replacements build their trainers alone while the others step (``RankWorker.prebuild``), so the rejoin pauses the
survivors for the rendezvous and the peer's state only. The recovery record lists the ``degraded_steps`` and
``skipped_sequences``; each of those steps' ``steps.jsonl`` line has ``replicas``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from orchestrator.events import event
from orchestrator.spec import JobSpec


def survivor_specs(spec: JobSpec, live: list[int], extra: dict | None = None) -> dict[int, dict]:
    """Each surviving rank's worker spec in the smaller group of ``live`` (grid ranks): the job at ``dp =
    len(live)``, reading the share of every global batch its grid position reads (``data_slot``)."""
    smaller = spec.model_copy(update={"parallel": spec.parallel.model_copy(update={"dp": len(live)})})
    worker_spec, grid = {**smaller.worker_dict(), **(extra or {})}, spec.parallel.grid
    return {r: {**worker_spec, "data_slot": [grid.coords(r).dp, grid.dp]} for r in live}


@dataclass
class Degraded:
    """The failed replicas being rebuilt while the others step: since which step, and the steps run without them."""

    dead: frozenset[int]
    at_step: int  # the failed step (the recovery record's ``at_step``)
    replicas: int  # replicas stepping meanwhile
    since: float = field(default_factory=time.perf_counter)
    steps: list[int] = field(default_factory=list)


class KeepTraining:
    """The job's degraded stretch, if one runs: entered by ``GridChanges.recover``, left by ``rejoin``."""

    def __init__(self, job):
        self.job = job
        self.degraded: Degraded | None = None

    def wanted(self, dead: set[int]) -> bool:
        """Whether a failure of ``dead`` (with replicas already being rebuilt) leaves a replica to train on."""
        pending = self.degraded.dead if self.degraded else frozenset()
        return self.job.spec.fault_tolerance.recovery == "keep_training" and \
            len(dead | pending) < self.job.spec.parallel.dp

    def go_on_without(self, dead: set[int], at_step: int) -> int:
        """The survivors re-form without ``dead`` (and any replicas still being rebuilt) and roll back to their
        newest common snapshot; returns its step. ``LookupError`` when they have none (the caller then recovers
        as ``replace_failed`` does)."""
        job = self.job
        before, failed = self.degraded, frozenset(dead)
        dead = failed | (before.dead if before else frozenset())
        job.group.form_without(dead)
        step = job.group.restore(set(), job.step)
        job.group.prebuild(failed)  # just started: they build meanwhile (one rebuilt before keeps its build)
        self.degraded = Degraded(dead, before.at_step if before else at_step, job.spec.parallel.dp - len(dead),
                                 steps=[s for s in (before.steps if before else []) if s <= step])
        event("keep_training", failed=sorted(dead), replicas=self.degraded.replicas, from_step=step,
              action="the other replicas train on, each on its own data; the failed replicas' share of these steps "
                     "is skipped; they rejoin from a live peer once rebuilt")
        return step

    def on_step(self, record: dict) -> None:
        """A step completed while degraded: its ``steps.jsonl`` line says how many replicas ran it; once every
        replacement is up, the window is asked to stop at the next boundary for them to rejoin."""
        deg = self.degraded
        if deg is None:
            return
        record["replicas"] = deg.replicas
        deg.steps = [s for s in deg.steps if s < record["step"]] + [record["step"]]  # a step run again: once

    def share(self) -> float:
        """The share of the replicas stepping now: a degraded step trains (and counts in tokens/s) only theirs."""
        deg = self.degraded
        return 1.0 if deg is None else deg.replicas / self.job.spec.parallel.dp

    def ready(self) -> bool:
        return self.degraded is not None and self.job.group.replacements_ready(self.degraded.dead)

    def rejoin(self) -> None:
        """At a step boundary: the replacements (waited for up to ``placement_timeout_s``; none placed: the grid
        shrinks to the survivors) join the full group and take a live peer's snapshot of this step."""
        job, deg = self.job, self.degraded
        t0 = time.perf_counter()
        job.take_snapshot()  # the survivors' state at this boundary: what the rebuilt replicas take
        if not job.group.placed(deg.dead, job.spec.fault_tolerance.placement_timeout_s):
            self.degraded = None
            job.changes.shrink(set(deg.dead))
            self._account(deg, "shrunk: dp is the survivors'", time.perf_counter() - t0)
            return
        job.layout = job.layout.with_ranks(job.group.form(keep=True))  # only the new ranks build
        job.step = job.group.restore(set(deg.dead), job.step)
        self.degraded = None
        if job.memory_every:  # the new ranks' own snapshot of the step, for a failure before the next one
            job.take_snapshot()
        self._account(deg, "from a live peer", time.perf_counter() - t0)

    def abandon(self) -> frozenset[int]:
        """A failure recovered as ``replace_failed`` (no whole replica left, no snapshot) while replicas are still
        being rebuilt: their replacements join that recovery, every rank waiting; returns their ranks."""
        deg, self.degraded = self.degraded, None
        if deg is None:
            return frozenset()
        self._account(deg, "in a recovery every rank waits for", 0.0)
        return deg.dead

    def _account(self, deg: Degraded, how: str, seconds: float) -> None:
        """The degraded steps and the sequences skipped into the recovery's summary record, and an event."""
        job = self.job
        skipped = len(deg.steps) * len(deg.dead) * (job.spec.train.global_batch_size // job.spec.parallel.dp)
        for record in reversed(job.recoveries):
            if record.get("degraded_steps") == [] and record["at_step"] == deg.at_step:
                record.update(degraded_steps=list(deg.steps), skipped_sequences=skipped,
                              rejoined_at_step=job.step, rejoin_s=round(seconds, 3))
                break
        event("rejoined", ranks=sorted(deg.dead), how=how, step=job.step, degraded_steps=len(deg.steps),
              replicas=deg.replicas, skipped_sequences=skipped, seconds=f"{seconds:.2f}",
              degraded_for_s=f"{time.perf_counter() - deg.since:.1f}")
