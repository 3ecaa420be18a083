"""``TrainingJob``: turns a validated spec into a running rank grid and drives it.

The controller runs in a detached Ray actor (``hosted.ControllerActor``, which
``raymesh run`` and a ``ray job submit`` entrypoint start and then only follow),
or in the calling process when used directly: it reserves placement, starts one
``RankWorker`` actor per rank, forms the process group, then runs the step
loop and returns the ``RunResult``. Its life is an explicit state machine
(``states.JobStateMachine``); what to do about a failed step or a resize is
decided by ``recovery.policy`` and carried out by ``GridChanges``; metrics and
the progress bar are observers it notifies; the cluster and rank group come
from a ``Runtime`` it is handed (Ray by default, a fake in the unit tests).
``status()``, ``request_stop()``, ``inject_fault()`` and ``request_scale()``
are what the control API serves while it runs.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from pydantic import ValidationError

from orchestrator.checkpoints import checksums
from orchestrator.checkpoints.base_pin import check_base_unchanged, record_base
from orchestrator.checkpoints.dir_lock import RESTART_WAIT_S, DirLocks
from orchestrator.checkpoints.directory import MODES, CheckpointDir
from orchestrator.checkpoints.job_record import check_resume
from orchestrator.checkpoints.start_checks import refuse_all_corrupt, refuse_fresh_run, refuse_nothing_to_resume
from orchestrator.errors import SpecError
from orchestrator.events import event
from orchestrator.faults.disk import corrupt_newest
from orchestrator.faults.schedule import FaultSchedule
from orchestrator.observability.observers import EventLog, Observers, ProgressBar, metrics_observer
from orchestrator.observability.remote_run_dir import run_dir_upload
from orchestrator.observability.run_records import (
    RunRecords,
    account_controller_loss,
    begin_life,
    held_out_loss,
    kept_steps,
    read_jsonl,
    summary_fields,
)
from orchestrator.observability.step_accounting import StepAccounting
from orchestrator.observability.trackers import tracker_observer
from orchestrator.planning.fast_defaults import pin_defaults
from orchestrator.planning.stage_split import auto_split, pin_split
from orchestrator.records import Layout
from orchestrator.recovery import node_loss
from orchestrator.recovery.elastic import resized
from orchestrator.recovery.policy import ScalingPolicy
from orchestrator.recovery.stragglers import StragglerDetector
from orchestrator.run_result import RunResult
from orchestrator.runtime.checkpointing import Checkpointing
from orchestrator.runtime.grid_changes import GridChanges
from orchestrator.runtime.group import RankGroupLike, Runtime, StepFailed
from orchestrator.runtime.ray_data import with_ray_dataset
from orchestrator.runtime.ray_runtime import RayRuntime
from orchestrator.runtime.states import JobState, JobStateMachine
from orchestrator.spec import FaultSpec, JobSpec, check_resources
from workers.contract.figures import figure_value
from workers.loop.plan import LoopFailed, Progress, Request, SaveRecord, StepRecord, Window, WindowEnd
from workers.protocol import RankInfo

if TYPE_CHECKING:
    from orchestrator.records import RecoveryRecord
    from orchestrator.recovery.phases import RecoveryPhases
    from orchestrator.runtime.ps_shards import PSShards


DETAIL_RANKS = 256  # ranks whose own phase times and memory the controller takes per step (Window.detail_every)
DRAIN_CHECK_S = 1.0  # how often a running window asks Ray whether a node of the grid is being drained


class RunComplete(Exception):
    """``--resume`` of a run whose newest checkpoint is already at ``train.steps``: there is nothing to train.

    Raised before anything starts or is written, so the finished run's ``summary.json`` and records stay as
    they are (resuming used to train zero steps and overwrite the summary with empty losses).
    """

    def __init__(self, step: int, run_dir: str | Path, checkpoint: Path):
        self.step, self.run_dir, self.checkpoint = step, run_dir, checkpoint
        super().__init__(f"the run in {run_dir} is complete: its newest checkpoint {checkpoint} is at step {step}, "
                         f"the job's train.steps; nothing was changed. To train further, resume with a larger "
                         f"train.steps (--resume --set train.steps=N)")


def refuse_if_complete(spec: JobSpec) -> None:
    """``RunComplete`` when resuming ``spec`` would train nothing: its newest intact checkpoint is at
    ``train.steps`` or past it (call before starting anything). Only one that passes its checksum check
    counts: a damaged final checkpoint is the resume's to set aside, which then continues from the one before."""
    ckpt = CheckpointDir(spec.checkpoint_dir(), spec.checkpoint.keep)
    for step in reversed(ckpt.complete_steps()):
        if step < spec.train.steps:
            return
        if checksums.problem(ckpt.path_for(step)) is None:
            raise RunComplete(step, spec.run_dir_url() or spec.resolved_run_dir(), ckpt.path_for(step))


def layout_of(spec: JobSpec, ranks: list[RankInfo], node_order: tuple[dict, ...] = ()) -> Layout:
    """The ``Layout`` record of ``spec``'s grid with ``ranks`` on it (``spec``'s ``pp_split`` pinned already) and
    the nodes in the order placement filled them (``RankPlacement.order``)."""
    p = spec.parallel
    return Layout(p.dp, p.pp, p.tp, p.zero, p.pp_schedule, p.stages_per_rank, spec.train.microbatches,
                  p.world_size, tuple(ranks), spec.stage_split, node_order)


class TrainingJob:
    """One job's controller: start-up, the step loop, and the surface the control API serves."""

    def __init__(self, spec: JobSpec, resume: bool = False, address: str | None = None, progress: bool = True,
                 runtime: Runtime | None = None, dataset=None, restarted: bool = False, job_id: str | None = None):
        """``dataset``: a ``ray.data.Dataset`` whose ``tokens`` column holds token-id rows, trained on instead of
        ``data.path`` (written once into the run dir: `orchestrator/runtime/ray_data.py`). ``restarted``: a hosted
        controller's new life after Ray lost its process: it resumes, starting over where the run never saved a
        checkpoint (a user's ``--resume`` is refused there), and waits for its previous life's run-dir lock.
        ``job_id``: what the run-dir lock names this run by (``raymesh run``'s id; default the job's name)."""
        if dataset is not None:
            spec = with_ray_dataset(spec, dataset, resume)
        self.split_chosen = auto_split(spec).describe() if spec.parallel.pp_split == "auto" else None
        spec = pin_split(spec)  # profiled once, before any actor starts; regrids keep it
        # recompute and compile the job left unset: the planner's fast settings on a GPU (event=defaults_picked)
        spec, self.defaults_picked = pin_defaults(spec)
        self.spec, self.resume, self.address, self.progress = spec, resume, address, progress
        self.runtime: Runtime = runtime or RayRuntime()
        self.run_dir = spec.resolved_run_dir()
        self.upload = run_dir_upload(spec)  # run_dir: s3://...: the staged files go up at checkpoints and the end
        steps_logged = None if progress else spec.train  # event=step lines where no progress bar shows the steps
        self.observers = Observers([EventLog(steps_logged), *([self.upload] if self.upload else [])])
        self.ckpt = CheckpointDir(spec.checkpoint_dir(), spec.checkpoint.keep,
                                  on_skip=lambda record: self.observers.on_corrupt_checkpoint(record),
                                  keep_best=spec.checkpoint.keep_best, permissions=spec.checkpoint.permissions)
        self.restarted = restarted
        self.locks = DirLocks(spec, job_id or spec.name, MODES[spec.checkpoint.permissions])
        self.checkpoints = Checkpointing(spec, self.ckpt, self.observers)
        self.machine = JobStateMachine()
        self.group: RankGroupLike | None = None
        self.placement = None
        self.control = None
        self.layout: Layout | None = None
        self.step = 0
        self.last: dict = {}
        self.started_unix = time.time()
        self.recoveries: list[dict] = []
        self.resizes: list[dict] = []  # ResizeRecord.to_dict() of every change of dp (tests watch it live)
        self.restarts = 0
        self.snapshot_step: int | None = None
        self.skip_batches: dict[int, int] = {}  # step -> batches skipped before it (repeated NaN there)
        self.faults = FaultSchedule(spec.faults)
        self.stragglers = StragglerDetector(spec.fault_tolerance.straggler_ratio, spec.fault_tolerance.straggler_steps)
        self._issue_lock = threading.Lock()  # the fault schedule: the control API's thread adds to it
        # the window the ranks run on their own (workers.loop): its number, the step before its first, whether it
        # runs, what was posted to it, rank 0's clock at the end of the last step, and the controller's own clock
        # at the last item it took (a failure found now happened since then)
        self._window_id = 0
        self._window_start = 0
        self._window_live = False
        self._posted: set[str] = set()
        self._mark = 0.0
        self._last_progress = time.perf_counter()
        self._poll_s = 1.0  # how long one wait for rank 0's next item lasts
        self._phase = "start"  # what the window's ranks are in, as rank 0 said last (the deadline follows it)
        self._drain_checked = 0.0  # when a window last asked Ray for draining nodes (``_check_drain``)
        self._draining: dict[str, float | None] = {}  # node -> seconds to its drain deadline, as first heard
        self._ranks_on: tuple[Layout | None, dict[str, list[int]]] = (None, {})  # a layout's ranks by node
        self._resize: tuple[JobSpec, str] | None = None  # a resize decided while a window ran, done after it
        self.scaling = ScalingPolicy(self.runtime.elastic(spec))
        self.changes = GridChanges(self)
        self.use_gpu = False
        self.ps: PSShards | None = None  # parameter-server shards under parallel.dp_sync: ps
        self._resume_recovery = None  # the record of a rank lost while the resume loaded, until the first step

    @property
    def memory_every(self) -> int:
        """Steps between in-memory snapshots for the current layout (``checkpoint.memory_every``)."""
        return self.spec.checkpoint.snapshot_every(self.spec.parallel, self.spec.optim)

    @property
    def state(self) -> str:
        return self.machine.public

    # -- what the control API serves ------------------------------------------------------

    def status(self) -> dict:
        return {
            "job": self.spec.name, "state": self.state, "step": self.step, "total_steps": self.spec.train.steps,
            "loss": self.last.get("loss"), "tokens_per_s": self.last.get("tokens_per_s", 0.0),
            "layout": self.layout.to_dict() if self.layout else {}, "started_unix": self.started_unix,
            # every rank took part in the last step, whether or not its record carried each rank's detail
            "health": dict.fromkeys((r.rank for r in self.layout.ranks) if self.layout else (),
                                    time.time() - self.last.get("time", self.started_unix)) if self.last else {},
        }

    def request_stop(self, reason: str = "") -> str:
        """Finish the current step, checkpoint if checkpoints are on, and end with status ``stopped``."""
        event("stop_requested", job=self.spec.name, reason=reason or "-", step=self.step)
        self.machine.request_stop()
        self._post_once("stop", Request(stop="stop"))  # a running window stops at its next boundary
        return self.state

    def inject_fault(self, kind: str, rank: int, factor: float) -> int:
        """Schedule ``kind`` on ``rank`` for the next step (validated like a job file's ``faults:`` entry)."""
        fault = {"kind": kind, "rank": rank, "at_step": self.step + 1, "factor": factor}
        checked = validated_fault(fault, self.spec, self.layout, self.runtime)
        with self._issue_lock:  # the step after the boundary rank 0 takes it at; the next window's first else
            at = self.group.post(Request(faults=(checked,))) if self._window_live else None
            checked["at_step"] = self.step + 1 if at is None else at + 1
            self.faults.add(checked)
        event("fault_requested", kind=kind, rank=rank, at_step=checked["at_step"])
        return checked["at_step"]

    def request_scale(self, dp: int) -> int:
        """Resize data parallelism to ``dp`` after the current step, keeping pp×tp and the global batch.

        Returns the step the new layout continues from. The microbatch count scales by
        old/new dp where it divides, so each microbatch keeps its size (gradient accumulation
        absorbs the difference); a layout the job file could not have is refused as ``ValueError``.
        """
        old = self.spec
        if old.parallel.dp_sync == "ps" and old.parameter_server.consistency != "bsp":
            raise ValueError(f"resizing is not supported with parameter_server.consistency "
                             f"{old.parameter_server.consistency} (each worker's clock belongs to one data rank); "
                             "fix: use consistency: bsp to scale a parameter-server job")
        try:
            target = resized(old, dp)
        except SpecError as exc:
            raise ValueError(str(exc)) from None
        self.scaling.request(target)
        at = self._post_once("resize", Request(stop="resize"))  # the running window stops at its next boundary
        at_step = self.step if at is None else at
        event("scale_requested", dp_from=old.parallel.dp, dp_to=dp, after_step=at_step)
        return at_step

    # -- the grid --------------------------------------------------------------------------

    def _start(self) -> Layout:
        p = self.spec.parallel
        self._refuse_foreign_checkpoints()
        if self.resume and not self.restarted:  # a restart may start over: its first life may never have saved
            refuse_nothing_to_resume(self.ckpt)
        if self.resume:  # a job file that reads the checkpoint otherwise: refused before any actor starts
            check_resume(self.spec)
        self.ckpt.set_aside_unsealed()  # saves of an earlier life cut short, copies without a manifest: kept
        self.ckpt.make_root()
        self.runtime.preflight(self.spec)
        self._pin_base()
        self._carry_skipped_batches()
        self.runtime.connect(self.address, p.world_size * p.cpus_per_rank)
        self.control = self.runtime.serve_control(self)  # after connect, so it advertises the node IP
        if self.control is not None:
            event("control", **self.control.announcement())
        cpus, gpus = self.runtime.available()
        self.use_gpu = p.device == "cuda" or (p.device == "auto" and gpus > 0)
        check_resources(self.spec, cpus, gpus, "cuda" if self.use_gpu else "cpu")
        return self.launch_grid()

    def _pin_base(self) -> None:
        """A QLoRA run re-reads its init_from base at every start: a resume checks it is the one pinned at the fresh
        start (`orchestrator.checkpoints.base_pin`), which records it."""
        if self.resume:
            check_base_unchanged(self.spec, self.ckpt.root, "resume")
        else:
            record_base(self.spec, self.ckpt.root)

    def _carry_skipped_batches(self) -> None:
        """A resume (a hosted controller's restart too) skips the batches the run skipped before (recorded beside
        the checkpoints as they were), else it trains a known-bad batch into NaN again; a fresh start forgets an
        earlier run's."""
        if self.resume:
            self.skip_batches = self.ckpt.skipped_batches()
        else:
            self.ckpt.forget_skipped_batches()

    def _refuse_foreign_checkpoints(self) -> None:
        """A fresh run into a directory that holds any checkpoint folder, sealed or not, is refused before any actor
        starts (``start_checks.refuse_fresh_run``)."""
        if not self.resume:
            refuse_fresh_run(self.ckpt, str(self.spec.run_dir_url() or self.run_dir))

    def launch_grid(self, timeout_s: float = 120.0) -> Layout:
        """Reserve placement for ``self.spec``'s grid, start its rank actors and form the process group."""
        p = self.spec.parallel
        self.placement = self.runtime.reserve(self.spec, self.use_gpu, timeout_s)
        if self.layout is None:  # the first grid: a job file's kill_node must hit a node it can take down
            self.runtime.check_job_faults(self.faults.pending, self.placement)
        self.group = self.runtime.start_group(self.spec, self.placement, self.use_gpu)
        fresh_shards = p.dp_sync == "ps" and self.ps is None
        if p.dp_sync == "ps":
            from orchestrator.runtime.ps_shards import PSShards  # here: it imports DCP (~1.5 s), PS jobs only

            self.ps = self.ps or PSShards(self.spec, self.run_dir)
            if self.ps.spec.parallel.dp != p.dp:  # bsp, a requested resize: the ranks load its checkpoint next
                self.ps.set_workers(self.spec)
            self.ps.publish_routes(self.group)
            self.checkpoints.beside_ranks = self.ps.save_checkpoint
        order = tuple(n.to_dict() for n in getattr(self.placement, "order", ()))  # the simulator's has none
        layout = layout_of(self.spec, self.group.form(), order)
        if fresh_shards:  # the ranks registered the initial weights: a rollback to step 0 finds them
            self.ps.keep(0, self.group)
        return layout

    def teardown_grid(self) -> None:
        """Stop the rank actors and give their placement back (nothing is left to stop should a relaunch fail)."""
        self.group.stop()
        self.placement.release()
        self.group = self.placement = None

    def _stop(self) -> None:
        if self.group is not None:
            self.group.stop()
            self.group = None
        if self.ps is not None:
            self.ps.write_read_log()
            self.ps.stop()
            self.ps = None
        if self.placement is not None:
            self.placement.release()
            self.placement = None
        self.observers.on_finish()
        self._upload()  # after the trackers closed their files; on a failure too

    def _upload(self) -> None:
        if self.upload is not None:
            self.upload.push()

    def take_snapshot(self) -> None:
        """Every rank snapshots the current step (replicas ship in the background)."""
        self.group.snapshot()
        if self.ps is not None:
            self.ps.keep(self.step, self.group)
        self.snapshot_step = self.step

    def load_from_disk(self, purpose: str, verified: Path | None = None) -> Path | None:
        """Load the newest checkpoint that passes its checksums into every rank (``verified``: that one, checked
        already); None when there is none (the freshly formed ranks keep their initial state, step 0)."""
        latest = verified or self.ckpt.latest_verified(purpose)
        self.step = self.group.call("load_checkpoint", str(latest))[0] if latest is not None else 0
        self.roll_back_shards(latest)
        return latest

    def roll_back_shards(self, checkpoint: Path | None) -> None:
        """Parameter-server shards follow the ranks to ``self.step``: from ``checkpoint``'s ``ps/`` folder, or
        the state they kept in memory at that step; then each rank pushes from that clock."""
        if self.ps is None:
            return
        self.ps.heal(self.step, self.group)  # a shard lost meanwhile would fail the restore: restarted first
        if checkpoint is not None:
            self.ps.restore_checkpoint(checkpoint, self.step)
        else:
            self.ps.roll_back(self.step)
        self.group.call("ps_resume")

    def from_disk(self, purpose: str, verified: Path | None = None) -> str:
        """The latest checkpoint that passes its checksums (resharded to the current grid), else step 0."""
        return "disk" if self.load_from_disk(purpose, verified) is not None else "initial"

    # -- the run -------------------------------------------------------------------------

    def run(self) -> RunResult:
        """The whole run, holding the run dir's lock (``orchestrator.checkpoints.dir_lock``): a second run into the
        same run dir or checkpoint dir is refused at once, naming this one."""
        self.locks.acquire(wait_s=RESTART_WAIT_S if self.restarted else 0.0)
        try:
            return self._run()
        finally:
            self.locks.release()

    def _run(self) -> RunResult:
        spec = self.spec
        if self.resume:
            refuse_if_complete(spec)
            if self.upload is not None:  # the records uploaded before a crash, to append to
                self.upload.pull()
        t_start = time.perf_counter()
        event("start", job=spec.name, world_size=spec.parallel.world_size, run_dir=spec.run_dir_url() or self.run_dir)
        try:
            self.layout = self._start()
            layout = self.layout
            pipeline = {"schedule": layout.pp_schedule, "pp_split": ",".join(map(str, layout.pp_split))} \
                if layout.pp > 1 else {}  # no pipeline, no schedule
            event("layout", dp=layout.dp, pp=layout.pp, tp=layout.tp, zero=layout.zero, **pipeline,
                  devices=layout.ranks[0].device)
            if self.split_chosen:
                event("pp_split", chosen=self.split_chosen)
            for observer in (metrics_observer(spec, self.run_dir, layout.to_dict()),
                             tracker_observer(spec, self.run_dir)):
                if observer is not None:
                    self.observers.add(observer)
            resumed_from = self._maybe_resume()
            self.machine.resume()
            result = self._loop(time.perf_counter() - t_start, resumed_from)
        except BaseException:
            self.machine.fail()
            self._close_control()
            raise
        finally:
            self._stop()
        self.machine.to(JobState(result.status))
        self._publish(result)
        self._close_control()  # only now: `raymesh status` needs the API or the summary line, never neither
        return result

    def _publish(self, result: RunResult) -> None:
        """The run's summary.json (uploaded with a URL run dir) and its ``finish`` and ``summary`` event lines."""
        summary = result.to_dict()
        RunRecords.write_summary(self.run_dir, summary)
        self._upload()
        failure = result.checkpoint_failure
        not_kept = {"not_kept": failure["steps_not_kept"], "last_checkpoint": failure["last_checkpoint"] or "none",
                    "reason": failure["reason"]} if failure else {}
        event("finish", job=self.spec.name, status=result.status, steps=len(result.losses),
              final_loss=result.final_loss, tokens_per_s=f"{result.tokens_per_s:.0f}", **not_kept)
        event("summary", json=json.dumps(summary, separators=(",", ":")))

    def finished_summary(self, done: RunComplete) -> dict:
        """The summary of a run this resume found complete (``done``), which a controller Ray restarted after the
        final save hands over: its summary.json, else (the lost controller died before writing it) one rebuilt
        from the run dir's step records and checkpoints, and written."""
        if self.upload is not None:  # the bucket's copy of the run dir
            self.upload.pull()
        path = self.run_dir / "summary.json"
        if path.is_file():
            return json.loads(path.read_text())
        event("summary_rebuilt", step=done.step, why="the run was complete without its summary.json",
              missing="recoveries, resizes, layout (the event log has them)")
        result = self._rebuilt_result(done.step)
        self._publish(result)
        return result.to_dict()

    def _rebuilt_result(self, step: int) -> RunResult:
        """What the run's step records (``steps.jsonl``) and checkpoints tell of its steps up to ``step``; the
        recoveries, resizes and layout of the controller that trained them are not in either."""
        path = self.run_dir / "steps.jsonl"
        records = [r for r in kept_steps(read_jsonl(path)) if r["step"] <= step] if path.is_file() else []
        checkpoints = [str(self.ckpt.path_for(s)) for s in self.ckpt.complete_steps()]
        return RunResult(steps=step, layout={}, checkpoints=checkpoints, best_checkpoint=self._best_checkpoint(),
                         run_dir=self.spec.run_dir_url() or str(self.run_dir), **summary_fields(records))

    def _close_control(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None

    def _maybe_resume(self) -> str | None:
        if not self.resume:
            return None
        try:
            latest = self.load_from_disk("resume")
        except StepFailed as failure:
            latest = self._resume_after_loss(failure)
        if latest is None:
            if self.ckpt.skipped:  # checkpoints there, none loads: never started over by itself
                refuse_all_corrupt(self.ckpt)
            if not self.restarted:  # a user's --resume of a job that never saved: not started over either
                refuse_nothing_to_resume(self.ckpt)
            event("resume", found="none", dir=self.ckpt.root, action="starting from step 0")
            return None
        event("resume", path=latest, step=self.step)
        return str(latest)

    def _resume_after_loss(self, failure: StepFailed) -> Path | None:
        """A rank lost while the resume loaded the checkpoint: recovered as the same loss is mid-run (replaced,
        and every rank loads the newest good checkpoint again), instead of failing the run. Returns what was
        loaded; the recovery's record waits for the first step (``_loop``)."""
        self.machine.resume()  # a recovery starts from running
        self.step = max(self.ckpt.complete_steps(), default=0)  # the step being resumed: nothing trained is lost
        self._resume_recovery = self._recover(failure, time.perf_counter())
        return self.ckpt.path_for(self.step) if self.step in self.ckpt.complete_steps() else None

    def _loop(self, startup_s: float, resumed_from: str | None) -> RunResult:
        records = RunRecords(self.run_dir, append=self.resume, timeline=self.spec.metrics.timeline)
        self.observers.add(records, first=True)
        acct = StepAccounting(self.spec, self.layout.ranks[0].device_name, self.observers, self.stragglers,
                              self.recoveries)
        lost = begin_life(self.run_dir, self.step, self.restarted, append=self.resume)
        if lost is not None:  # this controller's own loss, recovered from like any other
            account_controller_loss(acct, lost, self.layout.dp)
        if self.progress:
            self.observers.add(ProgressBar(self.spec.train.steps, self.step))
        if self._resume_recovery is not None:  # a rank lost while the resume loaded: its record waits for a step
            acct.rolled_back(self._resume_recovery, 0)
        if self.memory_every:
            self.take_snapshot()
        status = self._train(acct)
        failure = self.checkpoints.not_kept  # the last save failed: the trained weights are not on disk
        return RunResult(
            steps=self.step, losses=acct.losses, final_loss=acct.losses[-1] if acct.losses else None,
            tokens_per_s=sum(acct.step_tokens) / (time.perf_counter() - acct.t_train) if acct.losses else 0.0,
            layout=self.layout.to_dict(), checkpoints=self.checkpoints.saved, peak_memory_bytes=acct.peak,
            memory=acct.measured.summary(), grad_norms=acct.norms, startup_s=startup_s, step_time_s=acct.step_times,
            resumed_from=resumed_from, status="failed" if failure else status, recoveries=self.recoveries,
            goodput=acct.goodput(), checkpoint_failure=failure,
            stragglers=self.stragglers.episodes, corrupt_checkpoints=self.ckpt.skipped,
            resizes=self.resizes, ps_resizes=self.ps.resizes if self.ps else [], eval_losses=acct.eval_losses,
            run_dir=self.spec.run_dir_url() or str(self.run_dir), best_checkpoint=self._best_checkpoint(),
            data_mix=acct.data_mix, dpo=acct.dpo,
        )

    def _best_checkpoint(self) -> dict | None:
        """The summary's ``best_checkpoint``: the kept checkpoint with the lowest held-out loss, if any has one."""
        step = self.ckpt.best()
        if step is None:
            return None
        return {"step": step, "path": str(self.ckpt.path_for(step)), "eval_loss": self.ckpt.score(step)}

    def _train(self, acct: StepAccounting) -> str:
        """Windows of steps until the last one or a stop, then the last save (``Checkpointing.finish``: of the
        step the run ends at, when its save in the window failed); a rank lost in a step or in that save is
        recovered and training goes on, unless stopping: a stop saves the step restored and trains no further."""
        first, stopping = self.step, False
        while True:
            stopping = stopping or self._windows(acct, first)
            try:
                if self.checkpoints.every:
                    self.checkpoints.finish(self.group, self.step)
                acct.first_step_done("final_save")  # a recovery in that wait ends with it: no step follows
                return "stopped" if stopping else "finished"
            except StepFailed as failure:  # at the step whose save it waited for
                acct.rolled_back(self._recover(failure, time.perf_counter(), self.step), max(0, self.step - first))
                stopping = stopping or self.machine.stop_requested.is_set()

    def _windows(self, acct: StepAccounting, first: int) -> bool:
        """Windows until the last step or a stop (True when stopping); a failed window is recovered and training
        goes on, unless a stop was asked for (its own save lost a rank, or it came meanwhile): the caller then
        saves the step restored, with no step more."""
        while self.step < self.spec.train.steps:
            try:
                self._fire_controller_faults(self.step + 1)
                end = self._run_window(acct)
                # the loop numbers the ranks that step (keep_training: fewer); grid ranks before a rejoin renumbers
                told = [self.group.members[r] for r in end.ranks]
                self._between_windows(end)
                if self.changes.keep.degraded is not None:  # recovery: keep_training: the rebuilt replicas rejoin
                    self.changes.keep.rejoin()
                if end.reason == "stop":
                    return True
                if end.reason == "preempt" and self.step < self.spec.train.steps:
                    self._preempted(end.step, told)
                if self._resize is not None and self.step < self.spec.train.steps:
                    self._resize_now(acct)
            except StepFailed as failure:  # at the next step; at the last when its final save failed
                at_step = min(self.step + 1, self.spec.train.steps)
                acct.rolled_back(self._recover(failure, self._last_progress, at_step), max(0, self.step - first))
                if self.machine.stop_requested.is_set():
                    return True
        return False

    def _recover(self, failure: StepFailed, t0: float, at_step: int | None = None) -> tuple[RecoveryRecord,
                                                                                              RecoveryPhases]:
        """Recover from ``failure`` at ``at_step`` (default: the next step); a rank lost during the recovery
        itself (re-forming, restoring) starts it again with that rank replaced too, until the restart budget, or
        the cap on failed attempts in a row (``GridChanges.recovery_failed``), says to give up. Returns the
        pending recovery record."""
        self.machine.to(JobState.RECOVERING)
        at_step = self.step + 1 if at_step is None else at_step
        cut_short = self.checkpoints.forget_in_flight(self.step)  # once: a retried attempt must still save it again
        while True:
            try:
                record = self.changes.recover(failure, at_step, t0, cut_short)
                break
            except StepFailed as again:
                self.changes.recovery_failed(again, at_step)
                event("recovery_failed", reason=again, action="recovering again")
                failure = again
        self.machine.resume()
        self.observers.on_rollback(self.step)
        return record

    # -- one window ------------------------------------------------------------------------------

    def _window(self) -> Window:
        """The next window: up to the last step, or the step before the controller next acts itself (a fault it
        injects, a parameter-server job's work between steps); the ranks' faults, skips and cadences in it."""
        start = self.step + 1
        until = self.spec.train.steps
        if self.ps is not None:  # the shards keep, heal and resize between steps, with every rank idle
            until = start
        own_fault = self.faults.next_controller_step(start)
        if own_fault is not None:
            until = min(until, own_fault - 1)
        with self._issue_lock:
            once, slow = self.faults.planned(start, until)
        in_window = self.ps is None  # a PS job's checkpoints take the shards' part too: saved between windows
        world = self.spec.parallel.world_size  # per-rank detail: every step up to DETAIL_RANKS, else as often as
        detail_every = -(-world // DETAIL_RANKS)  # costs the controller one step's worth of DETAIL_RANKS ranks
        return Window(until=until, faults=once, slow=slow,
                      skips={s: n for s, n in self.skip_batches.items() if start <= s <= until},
                      snapshot_every=self.memory_every, checkpoint=self.checkpoints.plan(start, until, in_window),
                      detail_every=detail_every)

    def _run_window(self, acct: StepAccounting) -> WindowEnd:
        """Start the ranks' loops on the next window and supervise it: every record rank 0 hands over is
        accounted for and shown; returns how the window ended. Raises ``StepFailed`` when a rank died, hung or
        failed its step (or the loss was not finite): the steps recorded before it are kept."""
        window = self._window()
        self._window_id += 1
        self._window_start = self.step
        self._posted = set()
        self._last_progress = time.perf_counter()
        self.group.start_window(window, self._window_id)
        self._window_live, self._phase = True, "start"
        if self.machine.stop_requested.is_set():  # asked before the window began (start-up): its step, then stop
            self._post_once("stop", Request(stop="stop"))
        try:
            while True:
                items = self.group.window_items(min(self._poll_s, self._deadline(acct) / 4))
                if not items:
                    self._check_progress(acct)
                for item in items:
                    end = self._take(acct, item, window)
                    if end is not None:
                        return end
                self._check_drain()
        except StepFailed:
            with self._issue_lock:
                self.faults.fired_through(self.step + 1)  # the failed step's faults fired
            raise
        finally:
            self._window_live = False

    def _take(self, acct: StepAccounting, item, window: Window) -> WindowEnd | None:
        """One item from rank 0's desk; the window's end when it is that."""
        self._last_progress = time.perf_counter()
        if isinstance(item, StepRecord):
            self._on_record(acct, item)
        elif isinstance(item, SaveRecord):
            final = item.step >= self.spec.train.steps or self.machine.stop_requested.is_set()
            self.checkpoints.on_save(item, final)
            self._mark = max(self._mark, item.time)  # the step after a save starts when the save is done
        elif isinstance(item, Progress):
            self._phase = item.phase
            if item.phase == "window":
                self._mark = item.time
            elif item.phase == "save":
                self.checkpoints.saving(item.step)
        elif isinstance(item, LoopFailed):  # rank 0's loop raised: every rank says how its loop ended
            self.group.window_failed()
        elif isinstance(item, WindowEnd):
            with self._issue_lock:
                self.faults.fired_through(item.step)
            if item.reason == "nan_loss":
                raise StepFailed({}, kind="nan_loss")
            return item
        return None

    def _deadline(self, acct: StepAccounting) -> float:
        """How long the window may go without handing over an item before it counts as hung: ``hang_steps``
        typical steps (the median of the last twenty), at least ``hang_floor_s`` (both ``fault_tolerance``), so a
        frozen rank is found in seconds; a window's first step, a save, a step that evaluates and one after an
        occasional snapshot (slower, and not typical) get ``heartbeat_timeout_s``, which also caps the rest."""
        ft = self.spec.fault_tolerance
        ev, nxt = self.spec.eval, self.step + 1
        evaluates = bool(ev.every) and (nxt % ev.every == 0 or nxt == self.spec.train.steps)
        if self._phase != "step" or evaluates or not acct.step_times:
            return ft.heartbeat_timeout_s
        typical = statistics.median(acct.step_times[-20:])
        return min(ft.heartbeat_timeout_s, max(min(ft.hang_floor_s, ft.heartbeat_timeout_s), ft.hang_steps * typical))

    def _check_progress(self, acct: StepAccounting) -> None:
        """No item within the deadline: the group finds the stuck ranks and the window fails with them hung. The
        failure carries what the detection took (``StepFailed.detection``, into the recovery record): the deadline
        in force and the median step it followed, the silence when it was found, and the diagnosis (every rank's
        stacks) until the stuck ranks were killed, so a run's own records show the deadline rule was kept."""
        silent, deadline = time.perf_counter() - self._last_progress, self._deadline(acct)
        if silent < deadline:
            return
        typical = statistics.median(acct.step_times[-20:]) if acct.step_times else None
        t0 = time.perf_counter()
        try:
            self.group.window_hung(silent)
        except StepFailed as failure:
            failure.detection = {"deadline_s": round(deadline, 3), "silent_s": round(silent, 3),
                                 "median_step_s": None if typical is None else round(typical, 4),
                                 "diagnose_s": round(time.perf_counter() - t0, 3)}
            raise

    def _check_drain(self) -> None:
        """Once a second while a window runs: a node of the grid that Ray is draining (``ray drain-node``, an
        autoscaler's or KubeRay's preemption of a spot or evicted node) gets the preemption notice's treatment for
        every rank on it: rank 0 ends the window at the next step's boundary with that step saved, and the ranks
        then move to other nodes (``_preempted``). One call to Ray's GCS, whatever the world size."""
        now = time.perf_counter()
        if now - self._drain_checked < DRAIN_CHECK_S or "drain" in self._posted or self.layout is None:
            return
        self._drain_checked = now
        if self._ranks_on[0] is not self.layout:  # made once per layout, not once a second
            by_node: dict[str, list[int]] = {}
            for info in self.layout.ranks:
                by_node.setdefault(info.node_id, []).append(info.rank)
            self._ranks_on = (self.layout, by_node)
        ranks_on = self._ranks_on[1]
        draining = self.runtime.draining(ranks_on)
        if not draining:
            return
        self._draining.update({n: s for n, s in draining.items() if n not in self._draining})
        ranks = sorted(r for node in draining for r in ranks_on[node])
        at = self._post_once("drain", Request(preempted=tuple(ranks)))
        event("drain_notice", nodes=",".join(sorted(draining)), ranks=ranks, after_step=at,
              deadline_s=",".join("none" if s is None else f"{s:.0f}" for _, s in sorted(draining.items())))

    def _on_record(self, acct: StepAccounting, record: StepRecord) -> None:
        """Account for a completed step and show it; then what the controller asks of the running window. The
        record is the ranks' summary reduced in-band: nothing here grows with the ranks."""
        # a snapshot taken only every few steps runs before the next step, which is then not a typical one
        self._phase = "snapshot" if record.snapshot and self.memory_every > 1 else "step"
        summary = record.summary
        # an evaluation (eval.every) ran inside the step: not training time, so out of step time and tokens/s
        step_s = record.time - self._mark - (figure_value(summary.extras, "eval_s") or 0.0)
        self._mark = record.time
        if record.step == self._window_start + 1:
            self.group.start_spares()  # off the start-up's critical path; at once again after a recovery used one
        acct.first_step_done()
        self.changes.step_completed()
        self.checkpoints.scored(record.step, held_out_loss(summary))
        report = acct.step(summary, max(step_s, 1e-9), self.checkpoints.take_blocked(), self.spec.parallel.world_size,
                           self.changes.keep.share())
        self.changes.keep.on_step(report.record)  # a step the failed replicas sat out says how many ran it
        self.last = report.record
        self.step = record.step  # the step and its record become visible together (`status` reads both)
        if record.snapshot:
            self.snapshot_step = record.step
        with self._issue_lock:
            self.faults.fired_through(record.step)
        self.observers.on_step(report)  # after the step is shown: an observer (a dashboard, a test's gate) reads status
        self._ask_window(record.step)

    def _ask_window(self, step: int) -> None:
        """Post what the controller wants of the running window: a stop, a resize (requested or a grow-back), a
        repeating fault fallen due. Each at most once per window."""
        if self.machine.stop_requested.is_set():
            self._post_once("stop", Request(stop="stop"))
        if self._resize is None and step < self.spec.train.steps:
            self._resize = self.scaling.next_resize(self.spec, self.use_gpu)
        if self._resize is not None:
            self._post_once("resize", Request(stop="resize"))
        if self.changes.keep.ready():  # every failed replica's replacement is up: it rejoins at the next boundary
            self._post_once("rejoin", Request(stop="rejoin"))
        with self._issue_lock:
            due = self.faults.due_repeating(step + 1, self.spec.parallel.world_size)
        for fault in due:
            if fault["kind"] == "corrupt_checkpoint":
                corrupt_newest(self.ckpt)
                fault["fired"] = True
            elif fault["kind"] != "kill_ps_shard":  # a PS job's windows are one step: planned with the next
                at = self.group.post(Request(faults=(fault,))) if self._window_live else None
                fault["at_step"] = step + 1 if at is None else at + 1

    def _post_once(self, what: str, request: Request) -> int | None:
        """Post ``request`` to the running window unless it was posted already; the step at whose boundary rank 0
        takes it (None: no window runs, and the controller acts on it before the next one)."""
        if what in self._posted or not self._window_live:
            return None
        self._posted.add(what)
        return self.group.post(request)

    # -- between windows -------------------------------------------------------------------------

    def _fire_controller_faults(self, step: int) -> None:
        """The faults the controller injects itself before ``step`` (a window never runs past them)."""
        with self._issue_lock:
            own = self.faults.for_controller(step)
        for fault in own:
            if fault["kind"] == "kill_ps_shard":
                self.ps.arm(fault)
            else:  # corrupt_checkpoint
                corrupt_newest(self.ckpt)

    def _between_windows(self, end: WindowEnd) -> None:
        """A parameter-server job's work after each (one-step) window: the shards' between-step work, their
        snapshot beside the ranks', the checkpoint. A rank lost meanwhile raises ``StepFailed`` once the
        completed step is accounted for (it did complete)."""
        self._window_start = self.step
        if self.ps is None:
            return
        if self.memory_every and end.step % self.memory_every == 0:  # beside the ranks' snapshot of the step
            self.ps.keep(end.step, self.group)
        lost = self._shards_after_step(end.step)
        try:
            if lost is None:
                self.checkpoints.poll(self.group)
                if self.checkpoints.due(end.step, self.machine.stop_requested.is_set()):
                    self.checkpoints.save(self.group, end.step)
        except StepFailed as failure:
            lost = failure
        if lost is not None:
            raise lost

    def _shards_after_step(self, step: int) -> StepFailed | None:
        """The parameter-server shards' work between steps (``PSShards.after_step``) and its records; returns the
        failure of a rank lost while the ranks were pointed at a restarted shard or a resized ring, for the
        caller to raise once the completed step is accounted for (as a rank lost while saving is)."""
        try:
            self.ps.after_step(step, self.group)
            return None
        except StepFailed as failure:
            return failure
        finally:
            self._record_shard_recoveries()

    def _record_shard_recoveries(self) -> None:
        """The shards restarted since the last step: into the summary's recoveries and to the observers (the
        ``ps_shard`` kind of ``raymesh_recoveries_total``, the trackers' count), which saw none of them before."""
        for record in self.ps.recoveries:
            self.recoveries.append(record)
            self.observers.on_ps_shard_recovered(record)
        self.ps.recoveries.clear()

    def _preempted(self, step: int, ranks: list[int]) -> NoReturn:
        """Grid ``ranks`` had a preemption notice: the window ended at ``step`` with that step saved (a checkpoint
        when checkpoints are on, else a snapshot), so they go and are replaced as failed ranks are, nothing lost.
        Those on a draining node go to other nodes: their placement is reserved again without it (recovery kind
        ``drain``, naming the node)."""
        saved = self.ckpt.path_for(step) if step in self.ckpt.complete_steps() else "snapshot"
        nodes = sorted({self.layout.ranks[r].node_id for r in ranks} & set(self._draining))
        event("preempted", ranks=ranks, step=step, saved=saved,
              **({"drained": ",".join(nodes)} if nodes else {}))
        try:
            self.group.preempted(ranks, leave=tuple(nodes))
        except StepFailed as failure:
            if nodes:
                failure.kind, failure.node = "drain", ",".join(nodes)
            raise

    def _resize_now(self, acct: StepAccounting) -> None:
        """Carry out the resize decided while the window ran (requested, or a grow-back); a resize that went back
        in steps (its load fell back to an older checkpoint) cuts the account back to match."""
        decision, self._resize = self._resize, None
        self.machine.to(JobState.RESIZING)
        reached = self.step
        self.changes.resize(*decision)
        if self.step < reached:
            acct.cut_back(max(0, len(acct.losses) - (reached - self.step)))
            self.observers.on_rollback(self.step)
        self.machine.resume()


def validated_fault(fault: dict, spec: JobSpec, layout: Layout, runtime: Runtime) -> dict:
    """A live fault request checked like a job file's ``faults:`` entry, ready to schedule; ``ValueError`` if not.
    Its ``factor`` is dropped unless the kind is slow_rank: every request carries one (the API's default)."""
    if fault.get("kind") != "slow_rank":
        fault = {k: v for k, v in fault.items() if k != "factor"}
    try:
        checked = FaultSpec.model_validate(fault)
    except ValidationError as exc:
        raise ValueError(f"fault {fault}: {exc.errors()[0]['msg']}; fix: kind is one of kill_rank, kill_node, "
                         "hang_rank, slow_rank, nan_loss, raise_error, oom, corrupt_checkpoint "
                         "and factor > 1") from None
    world = spec.parallel.world_size
    if not 0 <= fault["rank"] < world:
        raise ValueError(f"fault rank {fault['rank']} is not a rank of this {world}-rank job; "
                         f"fix: pick a rank from 0 to {world - 1}")
    try:  # the checks across sections too: a fault kind this job cannot recover from is refused as in a job file
        JobSpec.from_dict({**spec.to_dict(), "faults": [checked.model_dump(mode="json")]})
    except SpecError as exc:
        raise ValueError(str(exc)) from None
    if checked.kind == "kill_node":
        problem = runtime.kill_node_refusal(fault["rank"], layout.ranks[fault["rank"]].node_id)
        if problem:
            raise ValueError(f"fault rank {fault['rank']}: {problem}; fix: {node_loss.FIX}")
    return checked.model_dump()
