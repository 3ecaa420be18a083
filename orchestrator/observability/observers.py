"""Who watches a job: event lines, Prometheus, the progress bar and the run records, notified by the job.

``TrainingJob`` tells its ``Observers`` what happened (``on_step``, ``on_checkpoint``, ``on_recovered``, ``on_resized``,
``on_corrupt_checkpoint``, ``on_ps_shard_recovered``, ``on_mttr``, ``on_rollback``, ``on_finish``); each
observer picks what it shows: ``EventLog`` the event lines, ``MetricsObserver``
the Prometheus series, ``ProgressBar`` the bar, ``RunRecords`` (``run_records.py``) the
``steps.jsonl``/``timeline.jsonl`` files. The job neither knows nor checks
whether metrics or a progress bar are on. ``JobObserver`` is the no-op base, so an observer writes only the
hooks it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from orchestrator.events import event
from orchestrator.observability.figures import event_fields
from orchestrator.observability.prometheus import MetricsExporter
from orchestrator.records import RecoveryRecord, ResizeRecord
from orchestrator.spec import JobSpec


@dataclass(frozen=True)
class StepReport:
    """One completed step as observers see it: its ``steps.jsonl`` record and the derived gauges."""

    record: dict
    mfu: float
    bubble: float
    goodput: float
    straggler_ratios: dict[int, float] = field(default_factory=dict)
    stragglers: frozenset[int] = frozenset()
    # the ranks' per-step figures folded (``workers.contract.figures.fold``): what readers of more than the record
    # take, e.g. the run records' pipeline events
    figures: dict = field(default_factory=dict)


class JobObserver:
    def on_step(self, report: StepReport) -> None: ...
    def on_checkpoint(self, blocking_s: float | None, committed: bool) -> None: ...
    def on_recovered(self, record: RecoveryRecord, step: int, restarted: int, phases_s: dict[str, float]) -> None:
        ...
    def on_resized(self, record: ResizeRecord, layout: dict) -> None: ...
    def on_corrupt_checkpoint(self, record: dict) -> None: ...
    def on_ps_shard_recovered(self, record: dict) -> None: ...
    def on_mttr(self, seconds: float) -> None: ...
    def on_rollback(self, step: int) -> None: ...
    def on_finish(self) -> None: ...


class Observers(JobObserver):
    """Every observer of one job, notified in order."""

    def __init__(self, observers: list[JobObserver] | None = None):
        self.observers = list(observers or [])

    def add(self, observer: JobObserver, first: bool = False) -> None:
        """Notify ``observer`` too; ``first`` puts it ahead of the others (the run records are written before
        anything that may block on a step, such as a scrape-paced exporter in the tests)."""
        self.observers.insert(0 if first else len(self.observers), observer)

    def on_step(self, report: StepReport) -> None:
        for o in self.observers:
            o.on_step(report)

    def on_checkpoint(self, blocking_s: float | None, committed: bool) -> None:
        for o in self.observers:
            o.on_checkpoint(blocking_s, committed)

    def on_recovered(self, record: RecoveryRecord, step: int, restarted: int, phases_s: dict[str, float]) -> None:
        for o in self.observers:
            o.on_recovered(record, step, restarted, phases_s)

    def on_resized(self, record: ResizeRecord, layout: dict) -> None:
        for o in self.observers:
            o.on_resized(record, layout)

    def on_corrupt_checkpoint(self, record: dict) -> None:
        for o in self.observers:
            o.on_corrupt_checkpoint(record)

    def on_ps_shard_recovered(self, record: dict) -> None:
        for o in self.observers:
            o.on_ps_shard_recovered(record)

    def on_mttr(self, seconds: float) -> None:
        for o in self.observers:
            o.on_mttr(seconds)

    def on_rollback(self, step: int) -> None:
        for o in self.observers:
            o.on_rollback(step)

    def on_finish(self) -> None:
        for o in self.observers:
            o.on_finish()


def logged(record: dict, train) -> bool:
    """Whether a step's figures go to the log and the trackers: every ``train.log_every``-th step, the last one
    and any that evaluated (its held-out loss would be lost otherwise). ``steps.jsonl`` keeps every step."""
    step = record["step"]
    return step % train.log_every == 0 or step >= train.steps or "eval_loss" in record


class EventLog(JobObserver):
    """The ``raymesh event=...`` lines of evaluations, recoveries and resizes (tests and operators grep them), and
    with ``train`` (the job's train section, given where no progress bar shows the steps) an ``event=step`` line
    per logged step."""

    def __init__(self, train=None):
        self.train = train

    def on_step(self, report: StepReport) -> None:
        record = report.record
        if self.train is not None and logged(record, self.train):
            event("step", step=record["step"], loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.3g}",
                  grad_norm=f"{record['grad_norm']:.3f}", tokens_per_s=f"{record['tokens_per_s']:.0f}",
                  step_s=f"{record['step_s']:.3f}",
                  **event_fields(record))  # each figure's own (observability/figures.py), e.g. DPO's rewards
        if "eval_loss" in record:
            event("eval", step=record["step"], loss=f"{record['eval_loss']:.4f}", seconds=f"{record['eval_s']:.2f}")

    def on_recovered(self, record: RecoveryRecord, step: int, restarted: int, phases_s: dict[str, float]) -> None:
        event("recovered", kind=record.kind, source=record.source, step=step, lost_steps=record.lost_steps,
              **{f"{k}_s": f"{v:.2f}" for k, v in phases_s.items()},
              **({"stacks": record.stacks} if record.stacks else {}))

    def on_resized(self, record: ResizeRecord, layout: dict) -> None:
        event("resized", reason=record.reason, dp_from=record.dp_from, dp_to=record.dp_to, step=record.at_step,
              source=record.source, microbatches=record.microbatches,
              **({"lost_steps": record.lost_steps} if record.lost_steps else {}))  # only when it went back


class MetricsObserver(JobObserver):
    """The job's Prometheus endpoint (``metrics.port``) and its file_sd target file."""

    def __init__(self, spec: JobSpec, run_dir: Path, layout: dict):
        self.job = spec.name
        self.exporter = MetricsExporter(spec.name, spec.metrics.port, spec.metrics.host)
        self.exporter.observe_layout(layout)
        target_file = spec.metrics.resolved_file_sd(run_dir)
        self.exporter.write_file_sd(target_file)
        event("metrics", address=self.exporter.address(), file_sd=target_file)

    def on_step(self, report: StepReport) -> None:
        self.exporter.observe_stragglers(report.straggler_ratios, set(report.stragglers))
        self.exporter.observe_step(report.record, report.mfu, report.bubble, report.goodput)

    def on_checkpoint(self, blocking_s: float | None, committed: bool) -> None:
        self.exporter.observe_checkpoint(blocking_s, committed=committed)

    def on_recovered(self, record: RecoveryRecord, step: int, restarted: int, phases_s: dict[str, float]) -> None:
        self.exporter.observe_recovery(record.kind, restarted, record.lost_steps)

    def on_resized(self, record: ResizeRecord, layout: dict) -> None:
        self.exporter.observe_layout(layout)

    def on_corrupt_checkpoint(self, record: dict) -> None:
        self.exporter.observe_recovery("corrupt_checkpoint", 0, 0)

    def on_ps_shard_recovered(self, record: dict) -> None:
        """A restarted parameter-server shard: its own kind, as no rank restarts and no step is lost; the MTTR
        gauge shows its restart time, the figure its record in ``summary.json`` and the report carry."""
        self.exporter.observe_recovery("ps_shard", 0, 0)
        self.on_mttr(record["mttr_s"])

    def on_mttr(self, seconds: float) -> None:
        self.exporter.mttr.labels(self.job).set(seconds)

    def on_finish(self) -> None:
        self.exporter.close()


class ProgressBar(JobObserver):
    """The terminal progress bar of ``raymesh run`` (loss, the latest held-out loss and tokens/s as its postfix)."""

    def __init__(self, total: int, initial: int):
        self.total = total
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
        self.eval_loss: float | None = None

    def on_step(self, report: StepReport) -> None:
        record = report.record
        self.eval_loss = record.get("eval_loss", self.eval_loss)
        held = {} if self.eval_loss is None else {"eval": f"{self.eval_loss:.4f}"}
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", **held, tok_s=f"{record['tokens_per_s']:.0f}")
        self.bar.update(1)

    def on_rollback(self, step: int) -> None:
        self.bar.reset(total=self.total)
        self.bar.update(step)

    def on_finish(self) -> None:
        self.bar.close()


def metrics_observer(spec: JobSpec, run_dir: Path, layout: dict) -> MetricsObserver | None:
    """The exporter when ``metrics.port`` is set (0 picks a free port), else None."""
    return MetricsObserver(spec, run_dir, layout) if spec.metrics.port is not None else None
