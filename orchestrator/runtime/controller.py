"""``TrainingJob``: turns a validated spec into a running rank grid and drives it.

The controller runs in the driver process (the ``raymesh run`` process, or the
entrypoint of a ``ray job submit``): it reserves placement, starts one
``RankWorker`` actor per rank, forms the process group, then runs the step
loop, the checkpoint cadence and bookkeeping, records and exports what
happens, and returns the ``RunResult``. ``status()`` and ``request_stop()``
are what the control API serves while it runs.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

from pydantic import ValidationError
from tqdm import tqdm

from orchestrator.api.control_server import ControlServer
from orchestrator.checkpoints.directory import CheckpointDir
from orchestrator.errors import SpecError
from orchestrator.faults.disk import corrupt_newest
from orchestrator.faults.schedule import FaultSchedule
from orchestrator.observability.events import event
from orchestrator.observability.prometheus import MetricsExporter
from orchestrator.observability.run_records import RunRecords
from orchestrator.observability.step_accounting import StepAccounting
from orchestrator.planning.disk_check import check_offload_space
from orchestrator.planning.memory_report import warn_if_too_big
from orchestrator.recovery import node_loss
from orchestrator.recovery.elastic import ElasticPolicy, resized
from orchestrator.recovery.phases import RecoveryPhases
from orchestrator.recovery.stragglers import StragglerDetector
from orchestrator.runtime import cluster
from orchestrator.runtime.placement import RankPlacement, reserve
from orchestrator.runtime.ps_shards import PSShards
from orchestrator.runtime.rank_group import RankGroup, StepFailed
from orchestrator.runtime.run_result import RunResult
from orchestrator.spec import FaultSpec, JobSpec, check_data_path, check_resources
from orchestrator.spec.lora import check_base_checkpoint


class TrainingJob:
    def __init__(self, spec: JobSpec, resume: bool = False, address: str | None = None, progress: bool = True):
        self.spec = spec
        self.resume = resume
        self.address = address
        self.progress = progress
        self.run_dir = spec.resolved_run_dir()
        self.ckpt = CheckpointDir(spec.checkpoint.resolved_dir(self.run_dir), spec.checkpoint.keep,
                                  on_skip=self._skipped_checkpoint)
        self.group: RankGroup | None = None
        self.placement: RankPlacement | None = None
        self.exporter: MetricsExporter | None = None
        self.control: ControlServer | None = None
        self.state = "starting"
        self.layout: dict = {}
        self.step = 0
        self.last: dict = {}
        self.started_unix = time.time()
        self._stop_requested = threading.Event()
        self.recoveries: list[dict] = []
        self.restarts = 0
        self.snapshot_step: int | None = None
        self._keep_from = -1  # snapshots older than this step are replicated everywhere and can go
        self.faults = FaultSchedule(spec.faults)
        self.stragglers = StragglerDetector(spec.fault_tolerance.straggler_ratio, spec.fault_tolerance.straggler_steps)
        self._issue_lock = threading.Lock()
        self._issued = 0  # the last step handed to the ranks
        self._resize_to: JobSpec | None = None
        self.elastic = ElasticPolicy(spec)
        self.resizes: list[dict] = []  # every change of dp: requested, shrunk after a loss, grown back
        self.use_gpu = False
        self.ps: PSShards | None = None  # parameter-server shards under parallel.dp_sync: ps

    # -- what the control API serves ------------------------------------------------------

    def status(self) -> dict:
        return {
            "job": self.spec.name, "state": self.state, "step": self.step, "total_steps": self.spec.train.steps,
            "loss": self.last.get("loss"), "tokens_per_s": self.last.get("tokens_per_s", 0.0),
            "layout": self.layout, "started_unix": self.started_unix,
            "health": {int(r): time.time() - self.last.get("time", self.started_unix)
                       for r in self.last.get("phases", {})},
        }

    def request_stop(self, reason: str = "") -> str:
        """Finish the current step, checkpoint if checkpoints are on, and end with status ``stopped``."""
        event("stop_requested", job=self.spec.name, reason=reason or "-", step=self.step)
        self._stop_requested.set()
        if self.state == "running":
            self.state = "stopping"
        return self.state

    def inject_fault(self, kind: str, rank: int, factor: float) -> int:
        """Schedule ``kind`` on ``rank`` for the next step (validated like a job file's ``faults:`` entry)."""
        with self._issue_lock:  # the first step not yet handed to the ranks
            fault = {"kind": kind, "rank": rank, "at_step": self._issued + 1, "factor": factor}
            self._add_fault(fault)
        event("fault_requested", kind=kind, rank=rank, at_step=fault["at_step"])
        return fault["at_step"]

    def request_scale(self, dp: int) -> int:
        """Resize data parallelism to ``dp`` after the current step, keeping pp×tp and the global batch.

        Returns the step the new layout continues from. The microbatch count scales by
        old/new dp where it divides, so each microbatch keeps its size (gradient accumulation
        absorbs the difference); a layout the job file could not have is refused as ``ValueError``.
        """
        old = self.spec
        if old.parallel.dp_sync == "ps":
            raise ValueError("resizing is not supported with parallel.dp_sync: ps (the shards count a fixed number "
                             "of data ranks); fix: use dp_sync: allreduce to scale")
        try:
            target = resized(old, dp)
        except SpecError as exc:
            raise ValueError(str(exc)) from None
        with self._issue_lock:
            self._resize_to = target
            self.elastic.target_dp = dp  # automatic grow-back aims here from now on
            at_step = self._issued
        event("scale_requested", dp_from=old.parallel.dp, dp_to=dp, after_step=at_step)
        return at_step

    def _add_fault(self, fault: dict) -> None:
        """Validate a live fault request like a job file's ``faults:`` entry and schedule it."""
        try:
            checked = FaultSpec.model_validate(fault)
        except ValidationError as exc:
            raise ValueError(f"fault {fault}: {exc.errors()[0]['msg']}; fix: kind is one of kill_rank, kill_node, "
                             "hang_rank, slow_rank, nan_loss, corrupt_checkpoint and factor > 1") from None
        if not 0 <= fault["rank"] < self.spec.parallel.world_size:
            world = self.spec.parallel.world_size
            raise ValueError(f"fault rank {fault['rank']} is not a rank of this {world}-rank job; "
                             f"fix: pick a rank from 0 to {self.spec.parallel.world_size - 1}")
        if checked.kind == "kill_node":
            problem = node_loss.refusal(fault["rank"], self.layout["ranks"][fault["rank"]]["node_id"])
            if problem:
                raise ValueError(f"fault rank {fault['rank']}: {problem}; fix: {node_loss.FIX}")
        self.faults.add(checked.model_dump())

    # -- start-up ------------------------------------------------------------------------

    def _use_gpu(self, gpus: float) -> bool:
        device = self.spec.parallel.device
        return device == "cuda" or (device == "auto" and gpus > 0)

    def _start(self) -> dict:
        p = self.spec.parallel
        check_data_path(self.spec)
        check_offload_space(self.spec)
        check_base_checkpoint(self.spec)
        warn_if_too_big(self.spec)
        cluster.connect(self.address, p.world_size * p.cpus_per_rank)
        self.control = ControlServer(self)  # after connect, so it advertises the node IP
        event("control", address=self.control.address)
        cpus, gpus = cluster.available()
        self.use_gpu = self._use_gpu(gpus)
        check_resources(self.spec, cpus, gpus, "cuda" if self.use_gpu else "cpu")
        return self._launch_grid()

    def _launch_grid(self, timeout_s: float = 120.0) -> dict:
        """Reserve placement for ``self.spec``'s grid, start its rank actors and form the process group."""
        p = self.spec.parallel
        self.placement = reserve(self.spec, self.use_gpu, timeout_s)
        if not self.layout:  # the first grid: a job file's kill_node must hit a node it can take down
            node_loss.check_job_faults(self.faults.pending, self.placement)
        self.group = RankGroup(self.spec, self.placement, self.use_gpu)
        if p.dp_sync == "ps":
            self.ps = self.ps or PSShards(self.spec, self.run_dir)
            self.group.worker_extra = {"ps_routes": self.ps.worker_routes()}
        return {
            "dp": p.dp, "pp": p.pp, "tp": p.tp, "zero": p.zero, "pp_schedule": p.pp_schedule,
            "virtual_stages": p.stages_per_rank, "microbatches": self.spec.train.microbatches,
            "world_size": p.world_size, "ranks": self.group.form(),
        }

    def _start_exporter(self) -> None:
        m = self.spec.metrics
        if m.port is None:
            return
        self.exporter = MetricsExporter(self.spec.name, m.port)
        self.exporter.observe_layout(self.layout)
        target_file = m.resolved_file_sd(self.run_dir)
        self.exporter.write_file_sd(target_file)
        event("metrics", address=self.exporter.address(), file_sd=target_file)

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
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None

    # -- checkpoints ---------------------------------------------------------------------

    def _save(self, step: int, saved: list[str]) -> float:
        """Issue a save; return the seconds training was blocked by it."""
        if self.spec.checkpoint.async_save:
            self._wait_async(saved)  # at most one save in flight; commit the previous one first
        t0 = time.perf_counter()
        path = self.ckpt.path_for(step)
        self.group.call("save_checkpoint", str(path), self.spec.checkpoint.async_save)
        blocked = time.perf_counter() - t0
        if self.exporter is not None:
            self.exporter.observe_checkpoint(blocked, committed=False)
        if not self.spec.checkpoint.async_save:
            self._committed(step, saved, blocked)
        return blocked

    def _wait_async(self, saved: list[str]) -> None:
        done = self.group.call("wait_checkpoint")
        if done[0] is not None:
            self._committed(done[0], saved, None)

    def _committed(self, step: int, saved: list[str], seconds: float | None) -> None:
        saved.append(str(self.ckpt.path_for(step)))
        self.ckpt.seal(step)
        removed = self.ckpt.prune()
        if self.exporter is not None:
            self.exporter.observe_checkpoint(None, committed=True)
        event("checkpoint", step=step, path=self.ckpt.path_for(step),
              seconds="async" if seconds is None else f"{seconds:.2f}", pruned=removed or "-")

    # -- the run -------------------------------------------------------------------------

    def run(self) -> RunResult:
        spec = self.spec
        t_start = time.perf_counter()
        event("start", job=spec.name, world_size=spec.parallel.world_size, run_dir=self.run_dir)
        try:
            self.layout = self._start()
            event("layout", dp=self.layout["dp"], pp=self.layout["pp"], tp=self.layout["tp"],
                  zero=self.layout["zero"], schedule=self.layout["pp_schedule"],
                  devices=self.layout["ranks"][0]["device"])
            self._start_exporter()
            resumed_from = self._maybe_resume()
            startup_s = time.perf_counter() - t_start
            self.state = "stopping" if self._stop_requested.is_set() else "running"
            result = self._loop(startup_s, resumed_from, t_start)
        except BaseException:
            self.state = "failed"
            self._close_control()
            raise
        finally:
            self._stop()
        self.state = result.status
        summary = result.to_dict()
        RunRecords.write_summary(self.run_dir, summary)
        event("finish", job=spec.name, status=result.status, steps=len(result.losses),
              final_loss=result.final_loss, tokens_per_s=f"{result.tokens_per_s:.0f}")
        event("summary", json=json.dumps(summary, separators=(",", ":")))
        self._close_control()  # only now: `raymesh status` needs the API or the summary line, never neither
        return result

    def _close_control(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None

    def _maybe_resume(self) -> str | None:
        if not self.resume:
            return None
        if self.ps is not None and self.ckpt.latest() is not None:
            raise RuntimeError("--resume with parallel.dp_sync: ps is not supported yet: checkpoints hold the ranks' "
                               "weights but not the shards' optimizer state; fix: start the run without --resume")
        latest = self._load_from_disk("resume")
        if latest is None:
            event("resume", found="none", dir=self.ckpt.root, action="starting from step 0")
            return None
        event("resume", path=latest, step=self.step)
        return str(latest)

    def _load_from_disk(self, purpose: str) -> Path | None:
        """Load the newest checkpoint that passes its checksums into every rank; None when there is none
        (the freshly formed ranks keep their initial state, step 0)."""
        latest = self.ckpt.latest_verified(purpose)
        self.step = self.group.call("load_checkpoint", str(latest))[0] if latest is not None else 0
        return latest

    def _skipped_checkpoint(self, record: dict) -> None:
        if self.exporter is not None:
            self.exporter.observe_recovery("corrupt_checkpoint", 0, 0)

    def _loop(self, startup_s: float, resumed_from: str | None, t_start: float) -> RunResult:
        spec = self.spec
        every = spec.checkpoint.every
        saved = []
        acct = StepAccounting(spec, self.layout["ranks"][0]["device_name"], self.run_dir, resumed_from is not None,
                              self.exporter, self.stragglers, self.recoveries)
        bar = tqdm(total=spec.train.steps, initial=self.step, disable=not self.progress, unit="step",
                   dynamic_ncols=True)
        status = "finished"
        first = self.step
        if spec.checkpoint.memory_every:
            self._snapshot()
        try:
            while self.step < spec.train.steps:
                t0 = time.perf_counter()
                try:
                    results = self._step_once()
                except StepFailed as failure:
                    acct.rolled_back(self._recover(failure, self.step + 1, t0), max(0, self.step - first))
                    bar.reset(total=spec.train.steps)
                    bar.update(self.step)
                    continue
                step_s = time.perf_counter() - t0
                self.step = results[0]["step"]
                if self.ps is not None:
                    self.ps.after_step(self.step, self.group)
                    self.recoveries.extend(self.ps.recoveries)
                    self.ps.recoveries.clear()
                acct.first_step_done()
                stopping = self._stop_requested.is_set()
                due = every and (self.step % every == 0 or self.step == spec.train.steps or stopping)
                ckpt_s = self._save(self.step, saved) if due else 0.0
                self.last = acct.step(results, step_s, ckpt_s, self.spec.parallel.world_size)
                bar.set_postfix(loss=f"{self.last['loss']:.4f}", tok_s=f"{self.last['tokens_per_s']:.0f}")
                bar.update(1)
                if not stopping and self.step < spec.train.steps:
                    self._maybe_resize(saved)
                if stopping:
                    status = "stopped"
                    break
            if every:
                self._wait_async(saved)
        finally:
            bar.close()
            acct.close()
        losses = acct.losses
        return RunResult(
            steps=self.step,
            losses=losses,
            final_loss=losses[-1] if losses else None,
            tokens_per_s=acct.tokens * len(losses) / (time.perf_counter() - acct.t_train) if losses else 0.0,
            layout=self.layout,
            checkpoints=saved,
            peak_memory_bytes=acct.peak,
            memory=acct.measured.summary(),
            grad_norms=acct.norms,
            startup_s=startup_s,
            step_time_s=acct.step_times,
            resumed_from=resumed_from,
            status=status,
            recoveries=self.recoveries,
            goodput=acct.goodput(),
            stragglers=self.stragglers.episodes,
            corrupt_checkpoints=self.ckpt.skipped,
            resizes=self.resizes,
        )

    def _step_once(self) -> list[dict]:
        """Issue the next step (with its faults, and a snapshot when one is due); raises ``StepFailed``."""
        with self._issue_lock:
            self._issued = self.step + 1
            faults_now = self.faults.for_step(self._issued, self.spec.parallel.world_size)
            for fault in self.faults.for_controller(self._issued):
                if fault["kind"] == "kill_ps_shard":
                    self.ps.arm(fault)
                else:  # corrupt_checkpoint
                    corrupt_newest(self.ckpt)
        memory_every = self.spec.checkpoint.memory_every
        keep_from = self._keep_from if memory_every and self._issued % memory_every == 0 else None
        results = self.group.step(faults_now, keep_from)
        if not all(math.isfinite(r["loss"]) for r in results if r["loss"] is not None):
            raise StepFailed({}, kind="nan_loss")
        if keep_from is not None:
            self.snapshot_step = self._issued
        self._keep_from = min(r["replicated_step"] for r in results)  # replicated on every rank: older can go
        return results

    # -- elastic data parallelism ---------------------------------------------------------

    def _maybe_resize(self, saved: list[str]) -> None:
        """Resize when one was requested, or grow back when the cluster has room again after a shrink."""
        with self._issue_lock:
            target, self._resize_to = self._resize_to, None
        reason = "request"
        if target is None:
            target, reason = self.elastic.grow(self.spec, self.use_gpu), "grow"
        if target is not None:
            self._resize(saved, target, reason)

    def _resize(self, saved: list[str], target: JobSpec, reason: str) -> None:
        """Checkpoint, stop the grid, start it at the new data-parallel degree and reshard on load."""
        t0 = time.perf_counter()
        old_dp = self.spec.parallel.dp
        self._wait_async(saved)
        path = self.ckpt.path_for(self.step)
        if str(path) not in saved:
            self.group.call("save_checkpoint", str(path), False)
            self._committed(self.step, saved, None)
        self.group.stop()
        self.placement.release()
        self.spec = target
        self.layout = self._launch_grid()
        self._load_from_disk("resize")  # the save just made, unless it fails its checksums
        if self.spec.checkpoint.memory_every:
            self._snapshot()
        self._resized(reason, old_dp, "disk", time.perf_counter() - t0)

    def _resized(self, reason: str, old_dp: int, source: str, seconds: float) -> None:
        """Bookkeeping after the grid was relaunched at a new dp: metrics, event and record."""
        if self.exporter is not None:
            self.exporter.observe_layout(self.layout)
        dp = self.spec.parallel.dp
        event("resized", reason=reason, dp_from=old_dp, dp_to=dp, step=self.step, source=source,
              microbatches=self.spec.train.microbatches)
        self.resizes.append({"reason": reason, "at_step": self.step, "dp_from": old_dp, "dp_to": dp,
                             "microbatches": self.spec.train.microbatches, "source": source, "seconds": seconds})

    def _shrink(self, dead: set[int]) -> str:
        """The dead ranks' replacements found no room: go on with the largest grid the live nodes hold.

        Where data-parallel replicas are full copies (zero 0) and a survivor of every (pp, tp) position
        kept its in-memory snapshot, the new grid starts from those (no storage); else from the latest
        checkpoint (DCP reshards it), else from step 0. Returns where the state came from.
        """
        t0 = time.perf_counter()
        old = self.spec
        kept = self.group.survivor_snapshots(dead, self.step) if self.snapshot_step is not None else None
        self.group.stop()
        self.placement.release()
        self.group = self.placement = None  # nothing left to stop should no smaller grid fit
        for option in self.elastic.shrink_options(old, self.use_gpu):
            self.spec = option
            try:
                self.layout = self._launch_grid(old.fault_tolerance.placement_timeout_s)
                break
            except SpecError as exc:  # not placeable after all (another tenant took the room): one smaller
                event("shrink_retry", dp=option.parallel.dp, reason=exc.problem)
        else:
            raise RuntimeError(f"no data-parallel degree down to fault_tolerance.min_dp={old.fault_tolerance.min_dp} "
                               "could be placed; fix: add nodes or lower fault_tolerance.min_dp")
        if kept is not None:
            self.step = self.group.restore_positions(*kept)
            source = "memory"
        else:
            source = self._from_disk("shrink")
        self._resized("shrink", old.parallel.dp, source, time.perf_counter() - t0)
        return source

    # -- recovery ------------------------------------------------------------------------

    def _snapshot(self) -> None:
        """Every rank snapshots the current step (replicas ship in the background)."""
        self.group.snapshot()
        self.snapshot_step = self.step
        self._keep_from = -1  # a new group, or rolled back: nothing is known replicated past here yet

    def _recover(self, failure: StepFailed, at_step: int, fault_time: float) -> dict:
        """Replace what died, re-form the group and roll every rank back; returns the pending recovery record."""
        phases = RecoveryPhases(fault_time)
        phases.lap("detect")
        ft = self.spec.fault_tolerance
        self.restarts += len(failure.dead)
        event("fault", kind=failure.kind, ranks=dict(failure.dead) or "-", at_step=at_step)
        if self.restarts > ft.max_restarts:
            raise RuntimeError(
                f"{failure} at step {at_step}: {self.restarts} rank restarts exceed fault_tolerance.max_restarts="
                f"{ft.max_restarts}; raise it, or look at the failing rank's log (`ray logs actor`)"
            ) from None
        completed = self.step
        before = {r["rank"]: {k: r[k] for k in ("pid", "actor_id", "node_id")} for r in self.layout["ranks"]}
        dp_before = self.spec.parallel.dp
        if ft.recovery == "restart_all":
            kind, source = failure.kind, self._restart_all()
            phases.lap("restart")
        else:
            kind, source = self._replace_failed(failure, phases)
        if self.spec.checkpoint.memory_every:
            self._snapshot()
            phases.lap("snapshot")
        if self.exporter is not None:
            self.exporter.observe_recovery(kind, len(failure.dead), completed - self.step)
        event("recovered", kind=kind, source=source, step=self.step, lost_steps=completed - self.step,
              **{f"{k}_s": f"{v:.2f}" for k, v in phases.seconds.items()})
        rank = min(failure.dead) if failure.dead else -1
        return {"kind": kind, "rank": rank, "at_step": at_step, "lost_steps": completed - self.step,
                "source": source, "identities_before": before, "phases": phases,
                "dp_from": dp_before, "dp_to": self.spec.parallel.dp}

    def _replace_failed(self, failure: StepFailed, phases: RecoveryPhases) -> tuple[str, str]:
        """New actors for the dead ranks only, a re-formed group and a rollback; a smaller grid when the
        replacements cannot be placed. Returns the recovery's kind and where the state came from."""
        ft = self.spec.fault_tolerance
        dead = set(failure.dead)
        kind = failure.kind
        if dead:
            self.group.replace(dead)  # starts now, while the survivors' failed step ends
            more = self.group.finish_failed_step()
            phases.lap("survivors")
            if more:
                self.group.replace(more)
                failure.dead.update(more)
                dead |= set(more)
                self.restarts += len(more)
            placed = self.group.placed(dead, ft.placement_timeout_s)
            if node_loss.gone(self.layout["ranks"][r]["node_id"] for r in dead):
                kind = "node"
            phases.lap("replace")
            if not placed:
                source = self._shrink(dead)
                phases.lap("shrink")
                return kind, source
            self.layout["ranks"] = self.group.form()
            phases.lap("form")
        source = self._roll_back(dead)
        phases.lap("restore")
        return kind, source

    def _roll_back(self, replaced: set[int]) -> str:
        """Newest consistent state: in-memory snapshots, else the latest checkpoint, else step 0."""
        if self.snapshot_step is not None:
            try:
                self.step = self.group.restore(replaced, self.step)
                return "memory"
            except LookupError as why:
                event("snapshot_lost", reason=why)
        if not replaced:
            raise RuntimeError(
                "a step produced a non-finite loss and there is no in-memory snapshot to roll back to; "
                "set checkpoint.memory_every (e.g. 1) to recover from NaN steps"
            )
        return self._from_disk("recovery")

    def _restart_all(self) -> str:
        """What Ray Train and torchrun do on any failure (``recovery: restart_all``, the benchmarks' baseline):
        tear down every rank, start the whole grid again and load the last checkpoint on disk."""
        self.group.stop()
        self.placement.release()
        self.layout = self._launch_grid()
        self.snapshot_step = None
        return self._from_disk("recovery")

    def _from_disk(self, purpose: str) -> str:
        """The latest checkpoint that passes its checksums (resharded to the current grid), else step 0."""
        return "disk" if self._load_from_disk(purpose) is not None else "initial"
