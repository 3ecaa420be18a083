"""The pipeline-schedule table: its facts, and that spec checks, stage placement and the memory model agree."""

from __future__ import annotations

from typing import get_args

import pytest
import torch.distributed.pipelining as pipelining

from orchestrator.errors import SpecError
from orchestrator.planning import memory_model as mm
from orchestrator.spec import JobSpec
from orchestrator.spec.fields import PipelineSchedule
from workers.contract.schedules import SCHEDULE_NAMES, SCHEDULES, schedule
from workers.parallel.layout import stage_ids

BASE = {"data": {"path": "data/tiny"}}


def spec(schedule_name: str, pp: int, microbatches: int, **parallel) -> JobSpec:
    return JobSpec.from_dict({**BASE, "model": {"n_layers": 8},
                              "parallel": {"pp": pp, "pp_schedule": schedule_name, **parallel},
                              "train": {"global_batch_size": 48, "microbatches": microbatches}})


def test_table_names_are_the_job_files_choices() -> None:
    assert SCHEDULE_NAMES == ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev",
                              "pipedream", "pipedream_2bw")
    assert get_args(PipelineSchedule) == SCHEDULE_NAMES


SYNCHRONOUS = [n for n, s in SCHEDULES.items() if not s.asynchronous]


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_torch_class_exists(name: str) -> None:
    assert isinstance(getattr(pipelining, SCHEDULES[name].torch_class), type)


def test_asynchronous_schedules_are_ours() -> None:
    """PipeDream's schedules have no torch class (workers.parallel.async_pipeline runs them) and stash weights."""
    assert [n for n, s in SCHEDULES.items() if s.asynchronous] == ["pipedream", "pipedream_2bw"]
    assert all(SCHEDULES[n].torch_class is None for n in ("pipedream", "pipedream_2bw"))
    # PipeDream: one version per microbatch in flight on the rank (pp - r); 2BW: two, whatever the depth
    assert [schedule("pipedream").weight_copies(4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert schedule("pipedream_2bw").weight_copies(4, 0, 8) == 2
    assert schedule("1f1b").weight_copies(4, 0, 8) == 0


def test_facts_per_schedule() -> None:
    assert [n for n, s in SCHEDULES.items() if s.single_stage] == ["gpipe", "1f1b", "pipedream", "pipedream_2bw"]
    assert [n for n, s in SCHEDULES.items() if s.interleaved] == ["interleaved_1f1b", "interleaved_zero_bubble"]
    assert [n for n, s in SCHEDULES.items() if s.v_shape] == ["zbv", "dualpipev"]
    assert [n for n, s in SCHEDULES.items() if s.split_backward] == ["interleaved_zero_bubble", "zbv", "dualpipev"]
    assert {n: s.default_stages_per_rank for n, s in SCHEDULES.items()} == {
        "gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "interleaved_zero_bubble": 2, "zbv": 2, "dualpipev": 2,
        "pipedream": 1, "pipedream_2bw": 1}
    assert {n: s.min_microbatches(4) for n, s in SCHEDULES.items()} == {
        "gpipe": 4, "1f1b": 4, "interleaved_1f1b": 4, "interleaved_zero_bubble": 4, "zbv": 4, "dualpipev": 8,
        "pipedream": 4, "pipedream_2bw": 4}
    assert schedule("gpipe").all_forwards_first and not schedule("1f1b").all_forwards_first


def test_stage_ids_loop_vs_v() -> None:
    loop, v = schedule("interleaved_1f1b"), schedule("zbv")
    assert (loop.placement, v.placement) == ("loop", "v")
    assert [loop.stage_ids(r, 4, 2) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [v.stage_ids(r, 4, 2) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert schedule("1f1b").stage_ids(2, 4, 1) == [2]
    assert stage_ids(1, 2, 2, "dualpipev") == [1, 2]


def test_unknown_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="pick one of.*dualpipev"):
        schedule("zb")


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_spec_agrees_with_table(name: str) -> None:
    facts = SCHEDULES[name]
    pp = 2
    need = facts.min_microbatches(pp)
    ok = spec(name, pp, need)
    assert ok.parallel.stages_per_rank == facts.default_stages_per_rank
    assert ok.parallel.pipeline_schedule is facts
    with pytest.raises(SpecError) as info:
        spec(name, pp, need - 1)
    assert info.value.field == "train.microbatches"


@pytest.mark.parametrize("name", ["interleaved_1f1b", "interleaved_zero_bubble"])
def test_interleaved_needs_multiple_of_pp(name: str) -> None:
    with pytest.raises(SpecError, match="multiple of parallel.pp=2"):
        spec(name, 2, 1)


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_zero3_refused_exactly_for_split_backward(name: str) -> None:
    build = lambda: spec(name, 2, 4, dp=2, zero=3)  # noqa: E731
    if SCHEDULES[name].split_backward:
        with pytest.raises(SpecError, match="deferred weight-gradient"):
            build()
    else:
        assert build().parallel.zero == 3


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_memory_model_uses_table(name: str) -> None:
    facts = SCHEDULES[name]
    v = facts.default_stages_per_rank
    for r in range(4):
        assert mm.in_flight_microbatches(name, 4, r, 8, v) == facts.in_flight(4, r, 8, v)
    assert facts.in_flight(1, 0, 8, v) == 1
    expected_rank0 = {"gpipe": 8, "1f1b": 4, "interleaved_1f1b": 11, "interleaved_zero_bubble": 11, "zbv": 8,
                      "dualpipev": 8, "pipedream": 4, "pipedream_2bw": 4}
    assert facts.in_flight(4, 0, 8, v) == expected_rank0[name]
