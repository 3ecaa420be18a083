"""The second round of hand-written malformed job files (beside the seeded fuzzer, test_spec_fuzz.py): each was
accepted silently, or refused with a message that did not say what to write, before its fix. Every case asserts
the field, the value and the fix in the message."""

from __future__ import annotations

from typing import Any

import pytest

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
    ({"checkpoint": {"every": 0, "keep": 5}}, "checkpoint.keep", 5, "set checkpoint.every"),
    ({"checkpoint": {"every": 0, "async": False}}, "checkpoint.async", False, "set checkpoint.every"),
    ({"optim": {"name": "adamw", "momentum": 0.9}}, "optim.momentum", 0.9, "remove optim.momentum"),
    ({"optim": {"name": "sgd", "betas": [0.8, 0.9]}}, "optim.betas", [0.8, 0.9], "remove optim.betas"),
    ({"optim": {"min_lr_ratio": 0.0}}, "optim.min_lr_ratio", 0.0, "optim.schedule: cosine"),
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
    {"parallel": {"dp": 2, "dp_sync": "ps"}, "parameter_server": {"optimizer": "momentum"},
     "optim": {"name": "sgd", "momentum": 0.9, "betas": [0.8, 0.9]}},  # the shards read what they read
])
def test_the_same_settings_where_the_job_reads_them_load(sections: dict[str, Any]):
    from orchestrator.spec import JobSpec

    JobSpec.from_dict({**DATA, **sections})
