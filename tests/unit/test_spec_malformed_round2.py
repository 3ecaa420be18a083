"""The second round of hand-written malformed job files (beside the seeded fuzzer, test_spec_fuzz.py): each was
accepted silently, or refused with a message that did not say what to write, before its fix. Every case asserts
the field, the value and the fix in the message."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.errors import SpecError
from tests.support.spec_errors import assert_actionable, spec_error

DATA = {"data": {"path": "d"}}


@pytest.mark.parametrize(("sections", "field", "value", "fix_part"), [
    # settings nothing in this job reads: the user believes they shape the run
    ({"eval": {"batches": 8}}, "eval.batches", 8, "set eval.every and eval.path"),
    ({"memory": {"offload": {"prefetch": 4}}}, "memory.offload.prefetch", 4, "memory.offload.optimizer"),
    ({"memory": {"offload": {"tier": "nvme", "path": "/nvme"}}}, "memory.offload.tier", "nvme",
     "memory.offload.optimizer"),
    ({"metrics": {"file_sd": "/t.json"}}, "metrics.file_sd", "/t.json", "set metrics.port"),
    ({"metrics": {"host": "0.0.0.0"}}, "metrics.host", "0.0.0.0", "set metrics.port"),
    ({"optim": {"name": "adamw", "momentum": 0.9}}, "optim.momentum", 0.9, "remove optim.momentum"),
    ({"optim": {"name": "sgd", "betas": [0.8, 0.9]}}, "optim.betas", [0.8, 0.9], "remove optim.betas"),
    ({"optim": {"min_lr_ratio": 0.0}}, "optim.min_lr_ratio", 0.0, "optim.schedule: cosine"),
    ({"model": {"moe": {"bias_update_rate": 0.01}}}, "model.moe.bias_update_rate", 0.01,
     "set model.moe.bias_balancing: true"),
    ({"faults": [{"kind": "slow_rank", "at_step": 3, "seed": 7}]}, "faults.0.seed", 7, "set every_s"),
    # contradictions and values no run can use
    ({"parallel": {"device_memory": 0}}, "parallel.device_memory", 0, "80GB"),
    ({"parallel": {"device_memory": -5}}, "parallel.device_memory", -5, "80GB"),
    ({"parallel": {"device_memory": "0GiB"}}, "parallel.device_memory", "0GiB", "80GB"),
])
def test_second_round_malformed_job_files_are_refused_naming_field_value_and_fix(sections, field, value, fix_part):
    assert_actionable(spec_error({**DATA, **sections}), field, value, fix_part)


@pytest.mark.parametrize("sections", [
    {"memory": {"offload": {"optimizer": True, "prefetch": 4}}},
    {"optim": {"name": "paged_adamw"}, "memory": {"offload": {"tier": "nvme", "path": "/nvme"}}},
    {"metrics": {"port": 0, "host": "0.0.0.0", "file_sd": "/t.json"}},
    {"checkpoint": {"every": 10, "keep": 5, "async": False}},
    {"eval": {"every": 5, "path": "d/heldout", "batches": 8}},
    {"optim": {"name": "sgd", "momentum": 0.9}},
    {"optim": {"name": "sm3", "momentum": 0.9}},
    {"optim": {"schedule": "cosine", "min_lr_ratio": 0.0}},
    {"model": {"moe": {"bias_balancing": True, "bias_update_rate": 0.01}}},
    {"faults": [{"kind": "kill_rank", "rank": "random", "every_s": 60, "seed": 7}]},
    {"optim": {"warmup_steps": 199}, "train": {"steps": 200}},
    # a quick run of a job file (--set train.steps=5, --set checkpoint.every=0): warm-up cut short and
    # checkpoints turned off on purpose (on by default, so every: 0 is never an oversight)
    {"optim": {"warmup_steps": 500}, "train": {"steps": 5}},
    {"checkpoint": {"every": 0, "keep": 5, "async": False}},
    {"parallel": {"device_memory": "80GB"}},
    {"parallel": {"dp": 2, "dp_sync": "ps"}, "parameter_server": {"optimizer": "momentum"},
     "optim": {"name": "sgd", "momentum": 0.9, "betas": [0.8, 0.9]}},  # the shards read what they read
])
def test_the_same_settings_where_the_job_reads_them_load(sections: dict[str, Any]):
    from orchestrator.spec import JobSpec

    JobSpec.from_dict({**DATA, **sections})


@pytest.mark.parametrize(("loggers", "field"), [
    ({"mlflow": {"experiment": ""}}, "loggers.mlflow.experiment"),  # was silently the job's name
    ({"mlflow": {"run_name": ""}}, "loggers.mlflow.run_name"),
    ({"wandb": {"project": ""}}, "loggers.wandb.project"),
    ({"wandb": {"entity": ""}}, "loggers.wandb.entity"),
])
def test_a_blank_tracker_name_is_refused(loggers, field):
    assert_actionable(spec_error({**DATA, "loggers": loggers}), field, "", "a non-empty string")


@pytest.mark.parametrize(("sections", "field", "fix_part"), [
    ({"loggers": {"tensorboard": {"dir": "FILE"}}}, "loggers.tensorboard.dir", "at a directory"),
    ({"loggers": {"wandb": {"dir": "FILE"}}}, "loggers.wandb.dir", "at a directory"),
    ({"data": {"path": "FILE"}}, "data.path", "raymesh prepare-data --out DIR"),
    ({"eval": {"every": 5, "path": "FILE"}}, "eval.path", "raymesh prepare-data --out DIR"),
])
def test_a_file_where_a_folder_belongs_is_refused_before_start(tmp_path, sections, field, fix_part):
    """A tracker opens its folder in the controller after the actors started; `prepare-data --out` a file fails."""
    import json

    from orchestrator.spec import JobSpec, check_before_start

    a_file = tmp_path / "file"
    a_file.write_text("x")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text(json.dumps({"total_tokens": 10**6, "shards": []}))
    raw = json.loads(json.dumps({"data": {"path": str(tmp_path / "data")}, "run_dir": str(tmp_path / "run"),
                                 **sections}).replace('"FILE"', json.dumps(str(a_file))))
    with pytest.raises(SpecError) as info:
        check_before_start(JobSpec.from_dict(raw), data_required=False)
    assert_actionable(info.value, field, str(a_file), fix_part)


@pytest.mark.parametrize(("sections", "field", "value", "fix_part"), [
    ({"optim": {"betas": [0.9]}}, "optim.betas", [0.9], "a list of 2 items"),  # was "set to a list", value unshown
    ({"model": {"lora": {"targets": []}}}, "model.lora.targets", [], "a list of at least 1 item"),
    ({"faults": {"kind": "oom"}}, "faults", {"kind": "oom"}, "one `- ` line per item"),
    ({"optim": {"lr": "nan"}}, "optim.lr", "nan", "a number (not nan or inf)"),  # was "written without quotes"
    ({"train": {"steps": "inf"}}, "train.steps", "inf", "a whole number (not nan or inf)"),
])
def test_wrong_shapes_say_what_to_write(sections, field, value, fix_part):
    msg = assert_actionable(spec_error({**DATA, **sections}), field, value, fix_part)
    assert "without quotes" not in msg
