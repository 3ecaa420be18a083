"""The controller with parameter-server shards (bsp) on the fake rank group and in-process shards, no Ray."""

from __future__ import annotations

import json

import pytest

from orchestrator.runtime.group import StepFailed
from tests.support.controller_jobs import kill, make_job
from tests.support.fake_group import FakeRuntime
from tests.support.fake_shards import fake_ps


def ps_job(tmp_path, faults=(), runtime=None, memory_every=3, **sections):
    return make_job(tmp_path, faults, runtime, parallel={"dp": 2, "dp_sync": "ps"},
                    parameter_server={"shards": 3, "chunk_elems": 4, "virtual_nodes": 8, **sections},
                    checkpoint={"every": 0, "memory_every": memory_every}, optim={"name": "adamw", "lr": 3e-3})


def shard_kill(at_step: int, shard: int = 1) -> dict:
    return {"kind": "kill_ps_shard", "shard": shard, "at_step": at_step}


def held(job, shard: int) -> tuple[set, list]:
    """The keys shard ``shard`` holds now and the steps it kept for a rollback."""
    real = job.ps.handles[shard].shard
    return set(real.params), sorted(real.kept)


@pytest.mark.parametrize("faults, memory_every", [
    ([shard_kill(3)], 3),  # dies in a snapshot step: every shard keeps step 3
    ([shard_kill(4), kill(1, 4)], 3),  # with a rank: the recovery aborts and rolls back every shard
    ([shard_kill(4), kill(1, 4)], 0),  # with a rank, no snapshots: every shard restores step 0's state
], ids=["snapshot-step", "with-a-rank", "with-a-rank-from-disk"])
def test_a_shard_lost_before_a_call_on_every_shard_is_restarted_first(tmp_path, monkeypatch, faults, memory_every):
    fake_ps(monkeypatch)
    job = ps_job(tmp_path, faults, memory_every=memory_every)
    keys = set()
    job.runtime.script[2] = lambda: keys.update(held(job, 1)[0])
    result = job.run()
    assert result.status == "finished" and result.steps == 10
    kinds = [(r["kind"], r["at_step"]) for r in result.recoveries]
    assert ("kill_ps_shard", faults[0]["at_step"]) in kinds
    assert not job.ps and keys  # the job stopped its shards; shard 1 held keys before it died


def test_a_shard_restarted_during_a_recovery_rolls_back_from_memory_with_its_keys(tmp_path, monkeypatch):
    """The restarted shard takes its keys and the kept steps from the live holders, so the rank's recovery rolls
    back from memory (nothing lost), not from disk or step 0."""
    fake_ps(monkeypatch)
    job = ps_job(tmp_path, [shard_kill(4), kill(1, 4)])
    seen = {}
    job.runtime.script[5] = lambda: seen.update(now=held(job, 1), route=job.group.worker_extra["ps_routes"])
    before = {}
    job.runtime.script[2] = lambda: before.update(keys=held(job, 1)[0])
    job.runtime.script[6] = lambda: job_handles.extend(job.ps.handles)
    job_handles: list = []
    result = job.run()
    rank = [r for r in result.recoveries if r["kind"] == "rank"]
    assert [(r["at_step"], r["source"], r["lost_steps"]) for r in rank] == [(4, "memory", 0)]
    assert seen["now"][0] == before["keys"] and 3 in seen["now"][1]
    assert seen["route"]["shards"][1]["handle"] is job_handles[1]  # ranks formed in the recovery get the live shard


def steps_lines(job) -> list[int]:
    return [json.loads(line)["step"] for line in (job.run_dir / "steps.jsonl").read_text().splitlines()]


def test_a_rank_lost_while_the_ranks_reshard_keeps_the_step_and_the_resize(tmp_path, monkeypatch):
    """After step 4 the shards go from 3 to 2 and rank 1 is lost as the ranks are pointed at the new ring: step 4
    is accounted for, the resize recorded, and the rank recovered; nothing is trained twice unreported."""
    fake_ps(monkeypatch)
    runtime = FakeRuntime(fail_calls={"ps_reshard": [StepFailed({1: "died"})]})
    job = ps_job(tmp_path, runtime=runtime, memory_every=1, resize=[{"at_step": 5, "shards": 2}])
    result = job.run()
    assert result.status == "finished" and result.losses == [1 / n for n in range(1, 11)]
    assert [(r["at_step"], r["shards_from"], r["shards_to"]) for r in result.ps_resizes] == [(5, 3, 2)]
    assert [(r["kind"], r["at_step"]) for r in result.recoveries] == [("rank", 5)]
    lines = steps_lines(job)
    assert sorted(set(lines)) == list(range(1, 11)) and len(lines) - 10 == sum(r["lost_steps"] for r in
                                                                              result.recoveries)


def test_a_rank_lost_while_rerouted_to_a_restarted_shard_keeps_every_record(tmp_path, monkeypatch):
    """Shard 1 dies in step 4 and rank 1 is lost as the ranks are rerouted to its restart: the step, the shard's
    restart and the rank's recovery are all recorded, and the ranks formed in that recovery use the live shard."""
    fake_ps(monkeypatch)
    runtime = FakeRuntime(fail_calls={"ps_reroute": [StepFailed({1: "died"})]})
    job = ps_job(tmp_path, [shard_kill(4)], runtime=runtime)
    seen = {}
    runtime.script[6] = lambda: seen.update(route=job.group.worker_extra["ps_routes"]["shards"][1]["handle"],
                                            live=job.ps.handles[1])
    result = job.run()
    assert result.status == "finished" and len(result.losses) == 10
    assert [(r["kind"], r["at_step"]) for r in result.recoveries] == [("kill_ps_shard", 4), ("rank", 5)]
    lines = steps_lines(job)
    assert 4 in lines and len(lines) - 10 == sum(r["lost_steps"] for r in result.recoveries)
    assert seen["route"] is seen["live"]


def test_a_restarted_shard_reaches_the_observers_as_a_recovery(tmp_path, monkeypatch):
    """A shard's restart is one of the summary's recoveries, so the observers are told of it too (the exporter's
    ``raymesh_recoveries_total{kind="ps_shard"}``, the trackers' count): only the summary had it."""
    fake_ps(monkeypatch)
    job = ps_job(tmp_path, [shard_kill(4)])
    result = job.run()
    assert [(r["kind"], r["shard"], r["at_step"]) for r in result.recoveries] == [("kill_ps_shard", 1, 4)]
    assert [seen for seen in job.recorder.seen if seen[0] == "ps_shard"] == [("ps_shard", 1, 4)]
