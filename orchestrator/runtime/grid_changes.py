"""Carrying out what the policies decide: recover a failed step, shrink, resize.

``RecoveryPolicy`` and ``ScalingPolicy`` decide; ``GridChanges`` executes on
the job's grid (replace actors, re-form, roll back, relaunch at another dp)
and keeps the bookkeeping (events, observers, records). Every decision taken
is appended to ``decisions``, so tests can assert on what was decided, not
only on where the job ended up.
"""

from __future__ import annotations

import time
from pathlib import Path

from orchestrator.errors import SpecError
from orchestrator.events import event
from orchestrator.records import RecoveryRecord, ResizeRecord
from orchestrator.recovery.keep_training import KeepTraining
from orchestrator.recovery.phases import RecoveryPhases
from orchestrator.recovery.policy import Action, Decision, Failure, RecoveryPolicy, RestartWindow
from orchestrator.runtime.group import ABANDONED, StepFailed
from orchestrator.spec import JobSpec


class GridChanges:
    def __init__(self, job):
        self.job = job  # a TrainingJob: its grid, step and snapshot bookkeeping are what changes here
        self.policy = RecoveryPolicy(job.spec)
        self.window = RestartWindow(job.spec.fault_tolerance.restart_window_s)  # restarts counted per window
        self.decisions: list[Decision] = []
        self.nan_times: dict[int, int] = {}  # step -> how often its loss was not finite
        self.failed_in_a_row = 0  # recovery attempts that failed since the last completed step
        self.keep = KeepTraining(job)  # recovery: keep_training's degraded stretch, while one runs

    def _decide(self, decision: Decision) -> Decision:
        self.decisions.append(decision)
        return decision

    # -- recovery --------------------------------------------------------------------------

    def recover(self, failure: StepFailed, at_step: int, fault_time: float,
                cut_short: int | None = None) -> tuple[RecoveryRecord, RecoveryPhases]:
        """Replace what died, re-form the group and roll every rank back; returns the pending recovery record.
        ``cut_short``: the step of an async save the failure cut short (``Checkpointing.forget_in_flight``, taken
        by the caller once for all attempts), saved again when the rollback restores exactly that step."""
        job = self.job
        phases = RecoveryPhases(fault_time)
        if job.ps is not None:  # both holders of a key lost: nothing to recover it from (says which updates)
            job.ps.check_keys_held(job.step)
        phases.lap("detect")
        restarted = len(failure.dead) or 1  # a NaN step's rollback counts too: a deterministic NaN must end
        job.restarts += restarted
        event("fault", kind=failure.kind, ranks=dict(failure.dead) or "-", at_step=at_step)
        seen = Failure(failure.kind, frozenset(failure.dead), at_step, str(failure))
        decision = self._decide(self.policy.on_failure(seen, self.window.spend(restarted)))
        if decision.action is not Action.GIVE_UP and failure.kind == "nan_loss":
            decision = self._on_nan(at_step)
        if decision.action is Action.GIVE_UP:
            raise RuntimeError(decision.message) from None
        completed = job.step
        before = {r.rank: r.identity for r in job.layout.ranks}
        dp_before = job.spec.parallel.dp
        if decision.action is Action.RESTART_ALL:
            kind, source = failure.kind, self._restart_all()
            phases.lap("restart")
        elif decision.action is Action.KEEP_TRAINING:
            kind, source = self._keep_training(failure, at_step, phases)
        else:
            kind, source = self._replace_failed(failure, phases)
        if job.memory_every:
            job.take_snapshot()
            phases.lap("snapshot")
        if cut_short is not None and cut_short == job.step:  # the restored state is the one that save held
            job.checkpoints.save(job.group, job.step)
        rank = min(failure.dead) if failure.dead else -1
        degraded = [] if self.keep.degraded is not None and decision.action is Action.KEEP_TRAINING else None
        record = RecoveryRecord(kind, rank, at_step, completed - job.step, source, before, dp_before,
                                job.spec.parallel.dp, stacks=failure.stacks, degraded_steps=degraded, node=failure.node,
                                detection=failure.detection)
        job.observers.on_recovered(record, job.step, len(failure.dead), phases.seconds)
        return record, phases

    def recovery_failed(self, again: StepFailed, at_step: int) -> None:
        """A recovery attempt failed (``again``): the policy says whether to try once more; ``RuntimeError`` with
        its message when the attempts in a row reach the cap (``RecoveryPolicy.on_failed_recovery``)."""
        self.failed_in_a_row += 1
        decision = self._decide(self.policy.on_failed_recovery(str(again), at_step, self.failed_in_a_row))
        if decision.action is Action.GIVE_UP:
            raise RuntimeError(decision.message) from None

    def step_completed(self) -> None:
        """A step completed: the recoveries before it succeeded, the count of failed ones in a row starts over."""
        self.failed_in_a_row = 0

    def _on_nan(self, at_step: int) -> Decision:
        """Count the NaN at ``at_step``; when the policy says so, have that step's batch skipped from now on."""
        times = self.nan_times[at_step] = self.nan_times.get(at_step, 0) + 1
        decision = self.decisions[-1] = self.policy.on_nan(at_step, times)  # refines on_failure's roll back
        if decision.action is Action.SKIP_BATCH:  # counted: the batch trained at this step next may be bad too
            skips = self.job.skip_batches[at_step] = self.job.skip_batches.get(at_step, 0) + 1
            self._record_skips()
            event("nan_batch_skipped", step=at_step, times=times, batches=skips,
                  action=f"{skips} batch(es) from step {at_step} on are skipped "
                         "(fault_tolerance.on_repeated_nan: skip_batch)")
        return decision

    def _record_skips(self) -> None:
        """The skipped batches beside the checkpoints, for a resume to skip too; a write that fails (disk full, the
        bucket unreachable) is logged, never the run's end: only a resume from before the skip meets the batch."""
        try:
            self.job.ckpt.record_skipped_batches(self.job.skip_batches)
        except Exception as exc:  # OSError locally, each fsspec back end its own
            event("skipped_batches_not_recorded", reason=repr(str(exc)[:200]),
                  action="training goes on; a resume from a checkpoint before the skip would train the batch again")

    def _replace_failed(self, failure: StepFailed, phases: RecoveryPhases) -> tuple[str, str]:
        """New actors for the dead ranks only, a re-formed group and a rollback; a smaller grid when the
        replacements cannot be placed. Returns the recovery's kind and where the state came from."""
        dead, kind = set(), failure.kind
        if failure.dead:
            kind, dead = self._start_replacements(failure, phases)
        return kind, self._rebuild(dead, phases)

    def _keep_training(self, failure: StepFailed, at_step: int, phases: RecoveryPhases) -> tuple[str, str]:
        """``recovery: keep_training``: the failed ranks' replacements start and the other replicas train on without
        them (``KeepTraining``); as ``replace_failed`` when no replica is left whole or the survivors hold no
        snapshot to roll their failed step back to."""
        kind, dead = self._start_replacements(failure, phases)
        if self.keep.wanted(dead):
            try:
                self.job.step = self.keep.go_on_without(dead, at_step)
                phases.lap("restore")
                return kind, "memory"
            except LookupError as why:
                event("snapshot_lost", reason=why, action="recovering as replace_failed: every rank waits")
        return kind, self._rebuild(dead, phases)

    def _rebuild(self, dead: set[int], phases: RecoveryPhases) -> str:
        """The dead ranks' replacements (and those of replicas an earlier ``keep_training`` stretch still rebuilds)
        placed and joined into a re-formed group, or a smaller grid when they cannot be placed; then the rollback.
        Returns where the state came from."""
        job = self.job
        if dead:
            dead |= self.keep.abandon()
            placed = job.group.placed(dead, job.spec.fault_tolerance.placement_timeout_s)
            phases.lap("replace")
            if self._decide(self.policy.on_placement(placed)).action is Action.SHRINK:
                source = self.shrink(dead)
                phases.lap("shrink")
                return source
            job.layout = job.layout.with_ranks(job.group.form())
            phases.lap("form")
        if job.ps is not None and job.ps.asynchronous and dead:  # nothing rolls back: the shards are current
            job.ps.rejoin(job.group, job.step)
            phases.lap("restore")
            return "shards"
        source = self._roll_back(dead)
        phases.lap("restore")
        return source

    def _start_replacements(self, failure: StepFailed, phases: RecoveryPhases) -> tuple[str, set[int]]:
        """Start the dead ranks' replacements while the survivors' failed step ends (a lost node shows
        more dead ranks meanwhile). Returns the kind (``node`` when a dead rank's node is gone) and the dead
        ranks."""
        job = self.job
        dead = set(failure.dead)
        job.group.replace(dead)  # starts now, while the survivors' failed step ends
        if job.ps is not None:  # survivors waiting on the shards (or the clock keeper) for the dead rank stop
            job.ps.abort(dead, job.group, job.step)
        more = job.group.finish_failed_step()
        phases.lap("survivors")
        if more:
            job.group.replace(more)
            failure.dead.update(more)
            dead |= set(more)
            collateral = sum(how != ABANDONED for how in more.values())  # abandoned survivors are not failures
            job.restarts += collateral
            self.window.spend(collateral)
        gone = job.runtime.nodes_gone(job.layout.ranks[r].node_id for r in dead)
        return ("node" if gone else failure.kind), dead

    def _roll_back(self, replaced: set[int]) -> str:
        """Newest consistent state: the in-memory snapshots or the latest good checkpoint, whichever loses fewer
        steps (the snapshots on a tie), else step 0. A restore that had to go back past the newest snapshot (one
        not complete everywhere) still gives way to a checkpoint newer than what it restored."""
        job = self.job
        reached = job.step
        newer = self._checkpoint_after(job.snapshot_step, reached, "recovery")
        decision = self._decide(self.policy.roll_back(job.snapshot_step is not None, bool(replaced), bool(newer)))
        if decision.source == "memory":
            try:
                job.step = job.group.restore(replaced, job.step)
                job.roll_back_shards(None)
            except LookupError as why:
                event("snapshot_lost", reason=why)
                decision = self._decide(self.policy.roll_back(False, bool(replaced)))
            else:
                newer = self._checkpoint_after(job.step, reached, "recovery")
                if newer is None:
                    return "memory"
                decision = self._decide(self.policy.roll_back(True, bool(replaced), newer_on_disk=True))
        if decision.action is Action.GIVE_UP:
            raise RuntimeError(decision.message)
        return self.from_disk(newer, reached)

    def _checkpoint_after(self, step: int | None, reached: int, purpose: str) -> Path | None:
        """The latest good checkpoint when it holds a step after ``step`` (a snapshot's; None: no snapshot) and
        not after ``reached`` (the last completed): rolling back to it loses fewer steps than to the snapshot.
        Its checksums are read only then, and a corrupt one is set aside as a load would (the one before it may
        lose more steps than the snapshot, and the snapshot wins)."""
        ckpt = self.job.ckpt
        if step is None or not any(step < s <= reached for s in ckpt.complete_steps()):
            return None
        latest = ckpt.latest_verified(purpose)
        return latest if latest is not None and step < ckpt.step_of(latest) <= reached else None

    def from_disk(self, verified: Path | None = None, reached: int | None = None) -> str:
        """Every rank loads the newest good checkpoint (``verified``: that one, checked already); says which steps
        that loses since ``reached`` (default: the current step), and loudly when there is no checkpoint at all
        and training starts over from step 0 (never silently)."""
        job = self.job
        reached = job.step if reached is None else reached
        source = job.from_disk("recovery", verified)
        lost = f"{job.step + 1}-{reached}" if reached > job.step else "none"
        if source == "disk":
            event("rolled_back_to_checkpoint", step=job.step, lost_steps=lost, path=job.ckpt.path_for(job.step))
        else:
            event("no_checkpoint", lost_steps=lost, action="STARTING OVER FROM STEP 0: no in-memory snapshot and no "
                  "checkpoint to fall back to; set checkpoint.every (e.g. 50) so a failure loses at most that many")
        return source

    def _restart_all(self) -> str:
        """What Ray Train and torchrun do on any failure (``recovery: restart_all``, the benchmarks' baseline):
        tear down every rank, start the whole grid again and load the last checkpoint on disk."""
        job = self.job
        job.teardown_grid()
        job.layout = job.launch_grid()
        job.snapshot_step = None
        return self.from_disk()

    # -- elastic data parallelism ----------------------------------------------------------

    def shrink(self, dead: set[int]) -> str:
        """The dead ranks' replacements found no room: go on with the largest grid the live nodes hold.

        Where data-parallel replicas are full copies (zero 0) and a survivor of every model position (pp, cp, tp)
        kept its in-memory snapshot, the new grid starts from those (no storage); else from the latest
        checkpoint (DCP reshards it), else from step 0. Returns where the state came from.
        """
        job = self.job
        if job.ps is not None:
            raise RuntimeError("the dead ranks' replacements found no room, and a run with parallel.dp_sync: ps does "
                               "not shrink after a failure (only `raymesh scale` resizes it, under bsp, through a "
                               "checkpoint); fix: add nodes, or `raymesh run JOB --resume --set parallel.dp=N` from "
                               "the last checkpoint (it reshards)")
        t0 = time.perf_counter()
        old = job.spec
        kept = job.group.survivor_snapshots(dead, job.step) if job.snapshot_step is not None else None
        newer = self._checkpoint_after(kept[0] if kept else None, job.step, "shrink")  # it loses fewer steps
        job.teardown_grid()
        self._launch_smaller(old)
        if kept is not None and newer is None:
            job.step = job.group.restore_positions(*kept)
            source = "memory"
        else:
            source = job.from_disk("shrink", newer)
        self._resized("shrink", old.parallel.dp, source, time.perf_counter() - t0)
        return source

    def _launch_smaller(self, old: JobSpec) -> None:
        """The largest layout the scaling policy offers that can actually be placed."""
        job = self.job
        for option in job.scaling.shrink_options(old, job.use_gpu):
            job.spec = option
            try:
                job.layout = job.launch_grid(old.fault_tolerance.placement_timeout_s)
                return
            except SpecError as exc:  # not placeable after all (another tenant took the room): one smaller
                event("shrink_retry", dp=option.parallel.dp, reason=exc.problem)
        raise RuntimeError(f"no data-parallel degree down to fault_tolerance.min_dp={old.fault_tolerance.min_dp} "
                           "could be placed; fix: add nodes or lower fault_tolerance.min_dp")

    def resize(self, target: JobSpec, reason: str) -> None:
        """Checkpoint, stop the grid, start it at the new data-parallel degree and reshard on load.

        Never fatal on its own: a rank lost during the save is recovered from like a failed step (``StepFailed``
        goes up; a requested resize is asked again, a grow-back comes again by itself); a save that fails
        otherwise (disk full) leaves the grid as it is; a new grid that cannot be started (placement,
        a rank lost while forming) gives way to the old layout again, from the save just made."""
        job = self.job
        t0 = time.perf_counter()
        old = job.spec
        try:
            job.checkpoints.save_now(job.group, job.step)
        except StepFailed:
            if reason == "request":
                job.scaling.request(target)  # taken up again once the recovery is done
            event("resize_failed", dp_to=target.parallel.dp, phase="save", action="recovering the lost rank first")
            raise
        except Exception as exc:
            event("resize_failed", dp_to=target.parallel.dp, phase="save", reason=repr(str(exc)[:200]),
                  action=f"staying at dp={old.parallel.dp}")
            return
        job.teardown_grid()
        job.snapshot_step = None  # the old grid's snapshots went with it
        self._relaunch(target, old)
        reached = job.step
        try:
            job.load_from_disk("resize")  # the save just made, unless it fails its checksums (then an older one)
        except StepFailed:  # the grid did change: recorded, then the lost rank's recovery loads the save again
            self._resized(reason, old.parallel.dp, "disk", time.perf_counter() - t0)
            raise
        if job.memory_every:
            job.take_snapshot()
        self._resized(reason, old.parallel.dp, "disk", time.perf_counter() - t0, reached - job.step)

    def _relaunch(self, target: JobSpec, old: JobSpec) -> None:
        """Start the grid at ``target``; when that fails, at ``old`` again (a failure there too is the job's)."""
        job = self.job
        job.spec = target
        try:
            job.layout = job.launch_grid()
            return
        except (SpecError, StepFailed) as exc:
            event("resize_failed", dp_to=target.parallel.dp, phase="relaunch", reason=repr(str(exc)[:200]),
                  action=f"back to dp={old.parallel.dp} from the checkpoint just saved")
            if job.group is not None:  # placed, then a rank lost while forming
                job.teardown_grid()
        job.spec = old
        job.layout = job.launch_grid()

    def _resized(self, reason: str, old_dp: int, source: str, seconds: float, lost_steps: int = 0) -> None:
        """Bookkeeping after the grid was relaunched at a new dp: observers (metrics, event) and the record, with
        the steps to train again when the load fell back to an older checkpoint (the controller cuts its
        account back by as many)."""
        job = self.job
        spec = job.spec
        record = ResizeRecord(reason, job.step, old_dp, spec.parallel.dp, spec.train.microbatches, source, seconds,
                              lost_steps)
        job.observers.on_resized(record, job.layout.to_dict())
        job.resizes.append(record.to_dict())
