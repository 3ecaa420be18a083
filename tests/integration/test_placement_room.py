"""A grid the cluster cannot place: refused at once when its nodes could never hold it, else waited for and then
refused naming what holds the room (it used to wait 120 s either way and then blame ``parallel.tp``)."""

from __future__ import annotations

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from orchestrator.errors import SpecError
from orchestrator.runtime.placement import NOTICE_S, reserve
from tests.support.events import recorded_events
from tests.support.jobs import tiny_spec

RAY_CPUS = 8  # tests/conftest.py's head


def held_by(spec) -> list[dict]:
    """The job's placement groups still holding (or waiting for) room."""
    return [pg for pg in placement_group_table().values()
            if pg["name"].startswith(f"{spec.name}-tp") and pg["state"] != "REMOVED"]


def test_a_group_no_node_holds_is_refused_before_any_wait(ray_cluster, token_data, tmp_path):
    spec = tiny_spec(token_data, tmp_path, parallel={"device": "cpu", "tp": 2, "cpus_per_rank": 5})
    with pytest.raises(SpecError) as info:
        reserve(spec, use_gpu=False, timeout_s=30)  # the old code waited all of it before it said anything
    assert info.value.field == "parallel.tp"
    assert f"even idle (nodes: {RAY_CPUS} CPU" in info.value.problem and "10 CPU" in info.value.problem
    assert held_by(spec) == []


def test_a_grid_that_finds_the_room_taken_waits_then_names_what_holds_it(ray_cluster, token_data, tmp_path):
    other = placement_group([{"CPU": RAY_CPUS - 1}], name="other-tenant")
    ray.get(other.ready(), timeout=60)
    spec = tiny_spec(token_data, tmp_path, parallel={"device": "cpu", "dp": 2})
    try:
        with recorded_events() as events, pytest.raises(SpecError) as info:
            reserve(spec, use_gpu=False, timeout_s=NOTICE_S + 2)
    finally:
        remove_placement_group(other)
    message = str(info.value)
    assert message.startswith("Ray cluster: could not place 2 group(s) of 1 x 1 CPU"), message
    assert f"'other-tenant' ({RAY_CPUS - 1} CPU on " in message and f"of {RAY_CPUS} CPU free" in message, message
    assert "raymesh stop ID" in info.value.fix and "parallel.tp" not in message
    waiting = [fields for name, fields in events if name == "placement_waiting"]
    assert len(waiting) == 1 and "'other-tenant'" in waiting[0]["held"], events
    assert held_by(spec) == []
