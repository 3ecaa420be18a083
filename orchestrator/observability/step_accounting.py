"""The controller's per-step bookkeeping: records, metrics, goodput, MTTR and stragglers.

``TrainingJob._loop`` decides what runs; this keeps the account of what ran:
the losses, grad norms and step times a ``RunResult`` reports (cut back when a
recovery rolls steps back), ``steps.jsonl``, peak and measured memory, the
Prometheus gauges, straggler ratios and, for each recovery, its record with
the MTTR and phase times once the next step completes. Goodput is productive
step time ÷ training wall time, the measure of issue 3; a step that stalled (over ``STALL_STEPS`` typical steps:
a rank frozen for a while but back before the progress deadline) counts only a typical step's time as
productive, and its record says ``stall_s``.
"""

from __future__ import annotations

import statistics
import time

from orchestrator.events import event
from orchestrator.observability.observers import JobObserver, StepReport
from orchestrator.observability.run_records import rank_peaks, step_record
from orchestrator.planning.flops import model_flops_per_token, peak_flops_per_rank, utilization
from orchestrator.planning.memory_report import MeasuredMemory
from orchestrator.records import RecoveryRecord
from orchestrator.recovery.phases import RecoveryPhases
from orchestrator.recovery.stragglers import StragglerDetector
from orchestrator.spec import JobSpec
from workers.contract.figures import figure_value
from workers.loop.summary import StepSummary

STALL_STEPS = 5  # a step over this many typical steps stalled: its excess is not productive time


class StepAccounting:
    def __init__(self, spec: JobSpec, device_name: str, observers: JobObserver, stragglers: StragglerDetector,
                 recoveries: list[dict]):
        self.spec = spec
        self.observers = observers
        self.stragglers = stragglers
        self.recoveries = recoveries  # the job's list: resizes and PS shards append to it too
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.step_times: list[float] = []
        self.stalls: list[float] = []  # per step, the seconds it ran past a typical step when it stalled, else 0
        self.step_tokens: list[int] = []  # per step, the tokens trained (fewer on a keep_training degraded step)
        self.evals: list[tuple[int, float] | None] = []  # per step, (step, held-out loss) where it evaluated
        self.peak: dict[int, int] = {}
        self.measured = MeasuredMemory(spec)
        self.tokens = spec.train.global_batch_size * spec.model.seq_len
        self.peak_per_rank = peak_flops_per_rank(spec, device_name)
        self.flops_per_token = model_flops_per_token(spec)
        self.pending: list[tuple[RecoveryRecord, RecoveryPhases]] = []  # waiting for the next completed step
        self.data_mix: dict[str, int] | None = None
        self.dpo: dict[str, float] | None = None  # train.objective: dpo: the newest step's reward figures
        self.t_train = time.perf_counter()

    def step(self, summary: StepSummary, step_s: float, checkpoint_s: float, world_size: int,
             share: float = 1.0) -> StepReport:
        """Account for one completed step (its summary, reduced over the ranks in-band); returns its report
        (``.record`` is its ``steps.jsonl`` record) for the controller to hand the observers once the job shows the
        step (an observer may read its status). Nothing here grows with the ranks but on a step with per-rank
        detail. ``share``: the share of the replicas that ran it (``recovery: keep_training`` while a failed one is
        rebuilt): the tokens trained, and the ranks whose peak the utilization is measured against, are that
        share of the whole grid's."""
        record = step_record(summary, step_s, round(self.tokens * share), time.time(), checkpoint_s)
        stall = self._stall(step_s)
        if stall:
            record["stall_s"] = round(stall, 3)
            event("stall", step=record["step"], seconds=f"{stall:.1f}", step_s=f"{step_s:.1f}",
                  why=f"over {STALL_STEPS}x the typical step: a rank or the network stood still")
        ratios = self.stragglers.observe_summary(record["step"], summary)
        self.losses.append(record["loss"])
        self.norms.append(record["grad_norm"])
        self.step_times.append(step_s)
        self.stalls.append(stall)
        self.step_tokens.append(record["tokens"])
        self.evals.append((record["step"], record["eval_loss"]) if "eval_loss" in record else None)
        self.data_mix = record.get("data_mix")  # data.mix: the newest step's count per source (a rollback's re-run
        # steps report the position they reach again)
        self.dpo = record.get("dpo")
        for rank, peak in rank_peaks(record).items():
            self.peak[rank] = max(self.peak.get(rank, 0), peak)
        measured = figure_value(summary.extras, "memory") or {}  # MeasuredMemory (planning) reads the JSON form
        self.measured.observe([{"rank": rank, "memory": memory} for rank, memory in measured.items()])
        peak_flops = self.peak_per_rank * world_size * share  # the grid may have been resized
        return StepReport(record, utilization(self.flops_per_token, record["tokens_per_s"], peak_flops),
                          summary.bubble_ratio, self.goodput(), ratios, frozenset(self.stragglers.flagged()),
                          summary.extras)

    def rolled_back(self, recovery: tuple[RecoveryRecord, RecoveryPhases], steps_kept: int) -> None:
        """A recovery rolled training back to ``steps_kept`` steps of this run; its record waits for
        the next completed step (MTTR ends there), beside any earlier one that no step has followed yet (a step
        failing again as it is re-run): each is kept, so the lost steps of all of them add up."""
        self.pending.append(recovery)
        self.cut_back(steps_kept)

    def cut_back(self, steps_kept: int) -> None:
        """Training went back to ``steps_kept`` steps of this run (a rollback, or a resize whose load fell back to
        an older checkpoint): the steps after it are trained again and reported once."""
        del self.losses[steps_kept:], self.norms[steps_kept:], self.step_times[steps_kept:], self.evals[steps_kept:]
        del self.stalls[steps_kept:], self.step_tokens[steps_kept:]

    @property
    def eval_losses(self) -> list[dict]:
        """The summary's ``eval_losses``: ``{step, loss}`` for every step kept that evaluated."""
        return [{"step": step, "loss": loss} for step, loss in filter(None, self.evals)]

    def first_step_done(self, phase: str = "first_step") -> None:
        """A step completed: a pending recovery ends here (its MTTR and phase times are recorded, the time since
        the recovery as ``phase``; ``final_save`` for one in the run's last wait, which no step follows)."""
        pending, self.pending = self.pending, []
        for record, phases in pending:
            phases.lap(phase)
            mttr = phases.total()
            self.recoveries.append(record.completed(mttr, {k: round(v, 3) for k, v in phases.seconds.items()})
                                   .to_dict())
            self.observers.on_mttr(mttr)

    def _stall(self, step_s: float) -> float:
        """The seconds ``step_s`` ran past a typical step (the median of the last twenty) when it took over
        ``STALL_STEPS`` of them: a rank frozen for a while, a stalled link. A step that evaluated is already
        counted without its evaluation; the first steps (no typical step yet) never stall."""
        if len(self.step_times) < 5:
            return 0.0
        typical = statistics.median(self.step_times[-20:])
        return step_s - typical if step_s > STALL_STEPS * typical else 0.0

    def goodput(self) -> float:
        """Productive step time ÷ training wall time: a step's stall is not productive."""
        return (sum(self.step_times) - sum(self.stalls)) / (time.perf_counter() - self.t_train)

