"""The `loggers:` trackers, fed fake step records and read back with each library's own reader.

TensorBoard's ``EventAccumulator``, MLflow's ``MlflowClient`` and the offline W&B run's ``.wandb`` file
(``tests/support/wandb_records.py``, with wandb's protobuf classes) must each hold every step's figures and the job
spec as parameters, matching what the observer was given.
"""

from __future__ import annotations

import pytest

from orchestrator import JobSpec, SpecError
from orchestrator.observability.observers import EventLog, StepReport
from orchestrator.observability.trackers import TrackerObserver, flat_params, tracker_observer
from orchestrator.records import RecoveryRecord
from orchestrator.spec import check_before_start
from tests.support import wandb_records
from tests.support.environ import kept_env
from tests.support.events import recorded_events
from tests.support.spec_errors import assert_actionable, spec_error
from tests.support.tracker_records import mlflow_run, mlflow_series, tensorboard_series, wandb_series

STEPS = 4


def fake_report(step: int) -> StepReport:
    """A completed step as the controller hands it to observers (two ranks, distinct peaks)."""
    record = {"step": step, "loss": 5.0 / step, "lr": 1e-3 * step, "grad_norm": 0.5 + step,
              "tokens_per_s": 1000.0 + step, "step_s": 0.25,
              "memory": {"0": {"peak_bytes": 1000 * step, "current_bytes": 1},
                         "1": {"peak_bytes": 3000 * step, "current_bytes": 1}}}
    return StepReport(record=record, mfu=0.01 * step, bubble=0.0, goodput=0.9)


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """A job with all three trackers, four steps logged and one recovery after step 2, then finished."""
    run_dir = tmp_path_factory.mktemp("trackers") / "run"
    spec = JobSpec.from_dict({"name": "tracked", "data": {"path": "data/x"}, "run_dir": str(run_dir),
                              "loggers": ["tensorboard", {"mlflow": {"experiment": "exp"}}, "wandb"]})
    # wandb.init leaves its service's address in the process's environment for child processes to share: the test
    # session's, so the integration tests' `ray start` would pass it to every actor (a controller logging to W&B
    # then used this process's service in the full suite and its own when run alone)
    with kept_env("WANDB_SERVICE"):
        observer = tracker_observer(spec, run_dir)
        for step in range(1, STEPS + 1):
            observer.on_step(fake_report(step))
            if step == 2:
                observer.on_recovered(RecoveryRecord("rank", 0, 2, 0, "memory", {}, 1, 1), 2, 1, {})
        observer.on_finish()
    return spec, run_dir


def expected(step: int) -> dict[str, float]:
    r = fake_report(step).record
    return {"loss": r["loss"], "lr": r["lr"], "grad_norm": r["grad_norm"], "tokens_per_s": r["tokens_per_s"],
            "mfu": 0.01 * step, "peak_memory_bytes": 3000.0 * step, "recoveries": float(step > 2)}


def series(key: str) -> list[tuple[int, float]]:
    return [(s, expected(s)[key]) for s in range(1, STEPS + 1)]


def test_tensorboard_event_files_hold_every_step_and_the_spec(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = logged
    for key in expected(1):
        read = tensorboard_series(run_dir / "tensorboard", key)  # stored as float32
        assert [s for s, _ in read] == list(range(1, STEPS + 1)), key
        assert [v for _, v in read] == pytest.approx([v for _, v in series(key)]), key
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    text = events.Tensors("job_spec/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "    name: tracked" in text and "    loggers.mlflow.experiment: exp" in text


def test_mlflow_run_has_every_step_and_the_spec_as_params(logged):
    spec, run_dir = logged
    _, run = mlflow_run(run_dir, "exp")
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    for key in expected(1):
        assert mlflow_series(run_dir, "exp", key) == series(key), key
    assert run.data.params == flat_params(spec) and run.data.params["model.d_model"] == str(spec.model.d_model)


def test_wandb_offline_run_file_has_every_step_and_the_spec(logged):
    spec, run_dir = logged
    for key in expected(1):
        read = wandb_series(run_dir, key)  # pytest >= 9.2's approx refuses nested (step, value) pairs
        assert [s for s, _ in read] == list(range(1, STEPS + 1)), key
        assert [v for _, v in read] == pytest.approx([v for _, v in series(key)]), key
    config = wandb_records.config(wandb_records.run_file(run_dir))
    assert {k: v for k, v in config.items() if not k.startswith("_")} == flat_params(spec)  # `_wandb`: its own


def test_a_logger_whose_package_is_missing_is_refused_naming_it_and_the_pip_command(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    spec = JobSpec.from_dict({"data": {"path": str(tmp_path / "none")}, "run_dir": str(tmp_path / "run"),
                              "loggers": {"wandb": None}})
    fix = r"pip install -e '.\[trackers\]'.*pip install wandb"
    with pytest.raises(SpecError, match=rf"`loggers.wandb`.*needs the `wandb` pack.*{fix}"):
        check_before_start(spec, data_required=False)


def test_loggers_as_a_list_or_a_mapping_mean_the_same_and_survive_a_round_trip():
    as_list = JobSpec.from_dict({"data": {"path": "d"}, "loggers": ["tensorboard", {"wandb": {"project": "p"}}]})
    as_map = JobSpec.from_dict({"data": {"path": "d"}, "loggers": {"tensorboard": None, "wandb": {"project": "p"}}})
    assert as_list.loggers == as_map.loggers and as_list.loggers.enabled() == ["tensorboard", "wandb"]
    assert JobSpec.from_dict(as_list.to_dict()).loggers == as_list.loggers
    with pytest.raises(SpecError, match=r"`loggers.tensorbord`.*did you mean `tensorboard`"):
        JobSpec.from_dict({"data": {"path": "d"}, "loggers": ["tensorbord"]})
    with pytest.raises(SpecError, match=r"`loggers`.*not a logger name"):
        JobSpec.from_dict({"data": {"path": "d"}, "loggers": [{"tensorboard": {}, "wandb": {}}]})


@pytest.mark.parametrize("loggers", [["tensorboard", "tensorboard"], [{"wandb": {"project": "a"}}, {"wandb": {}}]])
def test_a_logger_listed_twice_is_refused_not_merged(loggers):
    """A list has no duplicate-key check of its own: the second entry's settings would silently win."""
    err = spec_error({"data": {"path": "d"}, "loggers": loggers})
    name = next(iter(loggers[0])) if isinstance(loggers[0], dict) else loggers[0]
    assert "listed twice" in assert_actionable(err, f"loggers.{name}", {}, f"keep one `{name}` entry")


class Kept:
    """A tracker that keeps the steps and figures it was given."""

    def __init__(self):
        self.steps: list[int] = []
        self.metrics: list[dict[str, float]] = []

    def log_params(self, params):
        pass

    def log_metrics(self, metrics, step):
        self.steps.append(step)
        self.metrics.append(metrics)

    def close(self):
        pass


def test_log_every_sends_every_nth_step_the_last_and_each_that_evaluated_to_trackers_and_the_log():
    """train.log_every 3 over 8 steps, step 4 evaluated: 3, 4, 6 and 8 are logged; steps.jsonl keeps all."""
    spec = JobSpec.from_dict({"data": {"path": "d"}, "train": {"steps": 8, "log_every": 3}})
    kept, reports = Kept(), [fake_report(step) for step in range(1, 9)]
    reports[3].record["eval_loss"], reports[3].record["eval_s"] = 1.0, 0.1
    observer = TrackerObserver(spec, [kept])
    with recorded_events() as events:
        for report in reports:
            observer.on_step(report)
            EventLog(spec.train).on_step(report)
            EventLog(None).on_step(report)  # a progress bar shows the steps: no step lines
    assert kept.steps == [3, 4, 6, 8]
    lines = [fields for name, fields in events if name == "step"]
    assert [int(f["step"]) for f in lines] == [3, 4, 6, 8] and lines[0]["loss"] == f"{5.0 / 3:.4f}"


def test_a_restarted_parameter_server_shard_counts_in_the_recoveries_as_in_the_summary():
    spec = JobSpec.from_dict({"data": {"path": "d"}, "train": {"steps": 3}})
    kept = Kept()
    observer = TrackerObserver(spec, [kept])
    observer.on_step(fake_report(1))
    observer.on_ps_shard_recovered({"kind": "kill_ps_shard", "rank": -1, "shard": 1, "at_step": 2})
    observer.on_step(fake_report(2))
    assert [m["recoveries"] for m in kept.metrics] == [0.0, 1.0]
