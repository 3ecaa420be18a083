"""Experiment trackers (`loggers:`): TensorBoard, MLflow and Weights & Biases, fed by the controller.

One ``TrackerObserver`` per job runs where the controller runs and sends each completed step's figures (loss, LR,
grad norm, tokens/s, MFU, peak memory, goodput, recoveries so far) to every configured tracker, and the job spec,
flattened to ``section.field`` names, as the run's parameters. Ranks never talk to a tracker: one writer per run,
the way Ray Train and torchtitan log from one place. Each tracker is the library's own client (torch's
``SummaryWriter`` for TensorBoard's event files, ``MlflowClient``, ``wandb.init``); the adapters below only map
the three calls every tracker has (parameters once, metrics per step, close) onto them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol

from orchestrator.observability.figures import tracker_metrics
from orchestrator.observability.observers import JobObserver, StepReport, logged
from orchestrator.observability.run_records import rank_peaks
from orchestrator.records import RecoveryRecord
from orchestrator.spec import JobSpec

MLFLOW_PARAM_MAX = 6000  # MLflow refuses a longer parameter value
MLFLOW_BATCH_MAX = 100  # parameters per log_batch call MLflow accepts


class Tracker(Protocol):
    def log_params(self, params: dict[str, str]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


def flat_params(spec: JobSpec) -> dict[str, str]:
    """The job spec as ``section.field -> value`` strings (lists and empty sections as JSON)."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            out[prefix] = node if isinstance(node, str) else json.dumps(node)

    walk(spec.to_dict(), "")
    return out


def step_metrics(report: StepReport, recoveries: int) -> dict[str, float]:
    """One step's figures as trackers get them (the same names in every tracker; ``eval_loss`` on the steps that
    evaluated; under ``train.objective: dpo`` the reward figures as ``dpo/reward_accuracy`` etc., TRL's
    ``rewards/*``)."""
    r = report.record
    figures = {"loss": r["loss"], "lr": r["lr"], "grad_norm": r["grad_norm"], "tokens_per_s": r["tokens_per_s"],
               "step_s": r["step_s"], "mfu": report.mfu, "goodput": report.goodput, "recoveries": recoveries,
               "peak_memory_bytes": max(rank_peaks(r).values(), default=0),
               **tracker_metrics(r)}
    return {k: float(v) for k, v in figures.items() if v is not None}


class TensorBoardTracker:
    """Event files under ``dir``; the spec as one text summary (TensorBoard has no parameter table of its own
    outside the HParams plugin, which wants a metric per hyperparameter run)."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log_params(self, params: dict[str, str]) -> None:
        self.writer.add_text("job_spec", "\n".join(f"    {k}: {v}" for k, v in params.items()), global_step=0)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class MLflowTracker:
    """One MLflow run in ``experiment`` (created if missing) on ``tracking_uri``."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:MLFLOW_PARAM_MAX]) for k, v in params.items()]
        for i in range(0, len(items), MLFLOW_BATCH_MAX):
            self.client.log_batch(self.run_id, params=items[i:i + MLFLOW_BATCH_MAX])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now_ms, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker:
    """A W&B run (offline by default: its ``.wandb`` file under ``dir/wandb``, uploaded later by ``wandb sync``)."""

    def __init__(self, project: str, mode: str, out_dir: Path, entity: str | None, run_name: str):
        import wandb

        out_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, mode=mode, dir=str(out_dir), entity=entity, name=run_name,
                              settings=wandb.Settings(silent=True, console="off"))

    def log_params(self, params: dict[str, str]) -> None:
        self.run.config.update(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def open_trackers(spec: JobSpec, run_dir: Path) -> list[Tracker]:
    """Every tracker the job's ``loggers:`` section turns on, opened."""
    loggers, name = spec.loggers, run_dir.name
    trackers: list[Tracker] = []
    if loggers.tensorboard is not None:
        trackers.append(TensorBoardTracker(loggers.resolved_dir("tensorboard", run_dir)))
    if loggers.mlflow is not None:
        trackers.append(MLflowTracker(mlflow_uri(loggers.mlflow.tracking_uri, run_dir),
                                      loggers.mlflow.experiment or spec.name, loggers.mlflow.run_name or name))
    if loggers.wandb is not None:
        w = loggers.wandb
        trackers.append(WandbTracker(w.project, w.mode, loggers.resolved_dir("wandb", run_dir), w.entity,
                                     w.run_name or name))
    return trackers


def mlflow_uri(configured: str | None, run_dir: Path) -> str:
    """A tracking URI as given (``scheme:...``); else an SQLite file (relative: under the run dir; default
    ``RUN_DIR/mlflow.db``), MLflow's local store since 3.x refuses its old plain-directory one."""
    if configured and ":" in configured and not Path(configured).is_absolute():
        return configured
    db = Path(configured) if configured else Path("mlflow.db")
    return f"sqlite:///{(db if db.is_absolute() else run_dir / db).resolve()}"


class TrackerObserver(JobObserver):
    """Sends the job's parameters once and every completed step's figures to its trackers."""

    def __init__(self, spec: JobSpec, trackers: list[Tracker]):
        self.trackers, self.train = trackers, spec.train
        self.recoveries = 0
        params = flat_params(spec)
        for tracker in trackers:
            tracker.log_params(params)

    def on_step(self, report: StepReport) -> None:
        if not logged(report.record, self.train):  # train.log_every
            return
        metrics = step_metrics(report, self.recoveries)
        for tracker in self.trackers:
            tracker.log_metrics(metrics, report.record["step"])

    def on_recovered(self, record: RecoveryRecord, step: int, restarted: int, phases_s: dict[str, float]) -> None:
        self.recoveries += 1

    def on_ps_shard_recovered(self, record: dict) -> None:
        """A restarted shard is one of the summary's recoveries too, so it counts here as there."""
        self.recoveries += 1

    def on_finish(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def tracker_observer(spec: JobSpec, run_dir: Path) -> TrackerObserver | None:
    """The observer for the job's ``loggers:``, or None when there are none."""
    return TrackerObserver(spec, open_trackers(spec, run_dir)) if spec.loggers.enabled() else None
