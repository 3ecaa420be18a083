"""``train.batch_ramp``: the batch-size ramp-up schedule and its checks (seed 002 lines 179-184, 205, 291: the
batch size is a resource). The runs themselves: tests/integration/test_batch_ramp_parity.py."""

from __future__ import annotations

import pytest

from orchestrator.errors import SpecError
from tests.support.jobs import tiny_spec
from workers.contract.sections import BatchRampSection


def test_the_batch_climbs_in_whole_increments_then_stays_full():
    ramp = BatchRampSection(start=4, steps=3, increment=4)
    assert [ramp.batch_at(step, 16) for step in range(1, 7)] == [4, 8, 12, 16, 16, 16]
    slow = BatchRampSection(start=8, steps=10)  # increment null: start's own size
    assert [slow.batch_at(step, 32) for step in range(1, 13)] == [8, 8, 8, 8, 16, 16, 16, 24, 24, 24, 32, 32]


def _spec(token_data, tmp_path, ramp, **sections):
    train = {"global_batch_size": 16, "microbatches": 2, "batch_ramp": ramp, **sections.pop("train", {})}
    return tiny_spec(token_data, tmp_path, train=train, **sections)


def test_the_worker_spec_carries_it(token_data, tmp_path):
    spec = _spec(token_data, tmp_path, {"start": 4, "steps": 3}, parallel={"dp": 2, "device": "cpu"})
    assert spec.worker_dict()["train"]["batch_ramp"] == {"start": 4, "steps": 3, "increment": None}


@pytest.mark.parametrize(("ramp", "parallel", "field", "fix"), [
    ({"start": 16, "steps": 3}, {}, "train.batch_ramp.start", "set it below 16"),
    ({"start": 6, "steps": 3}, {"dp": 2}, "train.batch_ramp.start", "use a multiple of 4"),
    ({"start": 4, "steps": 3, "increment": 3}, {}, "train.batch_ramp.increment", "use a multiple of 2"),
    ({"start": 4, "steps": 3, "increment": 8}, {}, "train.batch_ramp.increment", "pick an increment dividing 12"),
    ({"start": 4, "steps": 3}, {"pp": 2}, "parallel.pp", "remove train.batch_ramp"),
])
def test_a_ramp_that_cannot_run_is_refused_naming_field_and_fix(token_data, tmp_path, ramp, parallel, field, fix):
    with pytest.raises(SpecError) as caught:
        _spec(token_data, tmp_path, ramp, parallel={"device": "cpu", **parallel})
    assert caught.value.field == field and fix in str(caught.value)
