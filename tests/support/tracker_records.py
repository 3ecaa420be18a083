"""A tracker's per-step series read back with that library's own reader (for the `loggers:` tests)."""

from __future__ import annotations

from pathlib import Path

from orchestrator.observability.trackers import mlflow_uri
from tests.support import wandb_records


def tensorboard_series(log_dir: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of a scalar, by TensorBoard's ``EventAccumulator`` (values are float32 there)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    return [(e.step, e.value) for e in events.Scalars(key)]


def mlflow_run(run_dir: Path, experiment: str):
    """(client, the one run) of ``experiment`` in the job's default local store, by ``MlflowClient``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri(None, run_dir))
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


def mlflow_series(run_dir: Path, experiment: str, key: str) -> list[tuple[int, float]]:
    client, run = mlflow_run(run_dir, experiment)
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


def wandb_series(out_dir: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) from the offline run's ``.wandb`` file (``wandb_records``)."""
    return [(row["_step"], row[key]) for row in wandb_records.history(wandb_records.run_file(out_dir)) if key in row]
