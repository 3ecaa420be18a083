"""`fault_tolerance.recovery: keep_training` on the fake rank group: the other replicas step on while the failed one
is rebuilt, it rejoins at a step boundary, and the summary says which steps ran without it. No Ray."""

from __future__ import annotations

import json

import pytest

from orchestrator.errors import SpecError
from orchestrator.recovery.policy import Action
from tests.support.controller_jobs import kill, make_job
from tests.support.fake_group import FakeRuntime
from tests.support.jobs import tiny_spec

KEEP = {"recovery": "keep_training"}


def keep_job(tmp_path, faults, runtime, dp=4):
    return make_job(tmp_path, faults, runtime=runtime, parallel={"dp": dp}, fault_tolerance=KEEP)


def steps_lines(job) -> list[dict]:
    return [json.loads(line) for line in (job.run_dir / "steps.jsonl").read_text().splitlines()]


def test_the_other_replicas_step_while_the_failed_one_is_rebuilt_then_it_rejoins(tmp_path):
    runtime = FakeRuntime(ready_after=2)
    job = keep_job(tmp_path, [kill(1, 4)], runtime)
    result = job.run()
    group = runtime.groups[0]
    assert result.status == "finished" and result.steps == 10 and len(result.losses) == 10
    assert Action.KEEP_TRAINING in [d.action for d in job.changes.decisions]
    # the survivors re-formed without rank 1 at the failed step, everyone again two steps later
    assert [(how, ranks) for how, _, ranks in group.formed] == [
        ("form", [0, 1, 2, 3]), ("form_without", [0, 2, 3]), ("form", [0, 1, 2, 3])]
    assert group.replaced == [{1}]
    (rec,) = result.recoveries
    assert (rec["kind"], rec["rank"], rec["at_step"], rec["source"], rec["lost_steps"]) == ("rank", 1, 4, "memory", 0)
    # steps 4..6 ran on three replicas: the readiness was asked at 4 and 5, yes at 6, taken at 7's boundary
    assert rec["degraded_steps"] == [4, 5, 6, 7] and rec["rejoined_at_step"] == 7
    assert rec["skipped_sequences"] == 4 * (job.spec.train.global_batch_size // 4)
    lines = steps_lines(job)
    assert [line["step"] for line in lines if line.get("replicas") == 3] == rec["degraded_steps"]
    assert all("replicas" not in line for line in lines if line["step"] not in rec["degraded_steps"])
    # a degraded step trained three replicas' shares: its tokens (and tokens/s, the summary's too) count those only
    full = job.spec.train.global_batch_size * job.spec.model.seq_len
    assert {line["tokens"] for line in lines} == {full, full * 3 // 4}
    assert all(line["tokens"] == full * 3 // 4 for line in lines if line["step"] in rec["degraded_steps"])
    assert job.machine.visited[-1].name == "FINISHED" and group.live is None


def test_the_survivors_keep_their_trainers_and_only_the_replacement_builds(tmp_path):
    """Re-forming the group without the failed replica, and again when its replacement rejoins, builds no trainer
    on the other replicas (``RankWorker.setup(keep_trainer=True)``): rank 1's grid position builds twice (its
    first process and the replacement), every other rank once, at the start. Under the default every rank builds
    again at the recovery."""
    runtime = FakeRuntime(ready_after=2)
    keep_job(tmp_path, [kill(1, 4)], runtime).run()
    assert runtime.groups[0].trainer_builds() == {0: 1, 1: 2, 2: 1, 3: 1}
    default = FakeRuntime()
    make_job(tmp_path / "default", [kill(1, 4)], runtime=default, parallel={"dp": 4}).run()
    assert default.groups[0].trainer_builds() == {0: 2, 1: 2, 2: 2, 3: 2}


def test_a_run_ending_while_degraded_has_the_replacement_rejoin_first(tmp_path):
    """The last steps ran without the failed replica: it still rejoins before the run ends, so every replica ends
    with the same state (the replacements are never ready here, until the run's end waits for them)."""
    runtime = FakeRuntime(ready_after=10_000)
    job = keep_job(tmp_path, [kill(2, 8)], runtime)
    result = job.run()
    (rec,) = result.recoveries
    assert rec["degraded_steps"] == [8, 9, 10] and rec["rejoined_at_step"] == 10
    assert runtime.groups[0].formed[-1][0] == "form" and runtime.groups[0].live is None


def test_the_default_stops_every_rank_and_never_forms_a_smaller_group(tmp_path):
    runtime = FakeRuntime()
    job = make_job(tmp_path, [kill(1, 4)], runtime=runtime, parallel={"dp": 4})
    (rec,) = job.run().recoveries
    assert "degraded_steps" not in rec
    assert [how for how, _, _ in runtime.groups[0].formed] == ["form", "form"]
    assert all("replicas" not in line for line in steps_lines(job))


def test_a_second_replica_lost_while_degraded_keeps_training_on_fewer(tmp_path):
    runtime = FakeRuntime(ready_after=10_000)
    job = keep_job(tmp_path, [kill(1, 3), kill(3, 5)], runtime)
    result = job.run()
    group = runtime.groups[0]
    assert [ranks for how, _, ranks in group.formed if how == "form_without"] == [[0, 2, 3], [0, 2]]
    first, second = result.recoveries
    assert first["degraded_steps"] == [3, 4, 5, 6, 7, 8, 9, 10]  # the stretch goes on through the second loss
    assert second["degraded_steps"] == [] and second["rank"] == 3  # part of the first's stretch
    assert [line.get("replicas") for line in steps_lines(job)][2:] == [3, 3, 2, 2, 2, 2, 2, 2]
    assert group.replaced == [{1}, {3}] and group.live is None and result.steps == 10


def test_losing_every_replica_falls_back_to_the_default_recovery(tmp_path):
    """With dp=2 and one replica already being rebuilt, losing the other leaves none to train on: every rank
    waits for the replacements, as under replace_failed, and the stretch before is still accounted for."""
    runtime = FakeRuntime(ready_after=10_000)
    job = keep_job(tmp_path, [kill(1, 3), kill(0, 5)], runtime, dp=2)
    result = job.run()
    group = runtime.groups[0]
    assert [how for how, _, _ in group.formed] == ["form", "form_without", "form"]
    assert result.recoveries[0]["degraded_steps"] == [3, 4] and result.status == "finished"


def test_a_nan_step_while_degraded_rolls_back_within_the_smaller_group(tmp_path):
    runtime = FakeRuntime(ready_after=3, nan_batches=frozenset({5}))
    job = keep_job(tmp_path, [kill(1, 4)], runtime)
    result = job.run()
    assert [how for how, _, _ in runtime.groups[0].formed] == ["form", "form_without", "form"]
    # NaN again at the same step: its batch is skipped, as on the full group
    assert result.steps == 10 and [r["kind"] for r in result.recoveries] == ["rank", "nan_loss", "nan_loss"]
    assert result.recoveries[0]["degraded_steps"] == [4, 5, 6, 7, 8]


@pytest.mark.parametrize(("parallel", "field", "words"), [
    ({"dp": 1}, "fault_tolerance.recovery", "parallel.dp=1"),
    ({"dp": 2, "tp": 2}, "fault_tolerance.recovery", "parallel.tp=2"),
    ({"dp": 2, "pp": 2}, "fault_tolerance.recovery", "parallel.pp=2"),
    ({"dp": 2, "zero": 1}, "fault_tolerance.recovery", "zero=1"),
])
def test_layouts_it_cannot_keep_training_on_are_refused_naming_the_fix(tmp_path, parallel, field, words):
    with pytest.raises(SpecError) as err:
        tiny_spec(tmp_path / "data", tmp_path, parallel=parallel, fault_tolerance=KEEP)
    assert err.value.field == field and words in str(err.value) and "replace_failed" in str(err.value)


def test_snapshots_turned_off_are_refused(tmp_path):
    with pytest.raises(SpecError) as err:
        tiny_spec(tmp_path / "data", tmp_path, parallel={"dp": 2}, fault_tolerance=KEEP, checkpoint={"memory_every": 0})
    assert err.value.field == "checkpoint.memory_every"
