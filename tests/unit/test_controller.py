"""The controller's whole state machine on a fake rank group: every transition, decision and record, no Ray."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
from pathlib import Path

import pytest
from ray.exceptions import RayTaskError

from orchestrator.checkpoints import checksums
from orchestrator.checkpoints.directory import CheckpointDir
from orchestrator.errors import SpecError
from orchestrator.observability.observers import JobObserver
from orchestrator.recovery.policy import NAN_WITHOUT_SNAPSHOT, Action
from orchestrator.runtime.controller import RunComplete
from orchestrator.runtime.group import StepFailed
from orchestrator.runtime.states import JobState
from tests.support.controller_jobs import kill, make_job
from tests.support.fake_group import FakeGroup, FakeRuntime

S = JobState
RECOVERY_KEYS = ["kind", "rank", "at_step", "lost_steps", "source", "identities_before", "dp_from", "dp_to",
                 "mttr_s", "phases_s"]


def actions(job) -> list[Action]:
    return [d.action for d in job.changes.decisions]


class ControllerLost(BaseException):
    """The controller's process dies mid-run (a hosted controller's restart resumes from the checkpoints)."""


def lose_controller():
    raise ControllerLost


# -- finishing and stopping --------------------------------------------------------------


def test_a_clean_run_finishes_through_starting_running_finished(tmp_path):
    job = make_job(tmp_path)
    result = job.run()
    assert result.status == "finished" and result.steps == 10 and len(result.losses) == 10
    assert job.machine.visited == [S.STARTING, S.RUNNING, S.FINISHED]
    assert job.state == "finished" and job.changes.decisions == [] and result.recoveries == []


def test_the_summary_is_written_with_the_status(tmp_path):
    job = make_job(tmp_path)
    job.run()
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 10


def test_a_stop_request_ends_the_run_stopped_after_the_current_step(tmp_path):
    runtime = FakeRuntime()
    job = make_job(tmp_path, runtime=runtime)
    runtime.script[4] = lambda: job.request_stop("test")
    result = job.run()
    assert result.status == "stopped" and result.steps == 4
    assert job.machine.visited == [S.STARTING, S.RUNNING, S.STOPPING, S.STOPPED]


def test_a_stop_asked_during_start_up_trains_the_first_step_then_stops(tmp_path):
    """As a stop mid-run finishes the step in flight, one asked before the first step lets it run (a submitted job
    stopped as soon as `raymesh status` shows it ends with a step trained, not none)."""
    job = make_job(tmp_path)
    job.request_stop("early")
    result = job.run()
    assert result.status == "stopped" and result.steps == 1 and len(result.losses) == 1


def test_a_stop_checkpoints_when_checkpoints_are_on(tmp_path):
    runtime = FakeRuntime()
    job = make_job(tmp_path, runtime=runtime, checkpoint={"every": 100, "memory_every": 1})
    runtime.script[3] = lambda: job.request_stop()
    result = job.run()
    assert [p.rsplit("-", 1)[1] for p in result.checkpoints] == ["00000003"]


@pytest.mark.parametrize("async_save, fail_calls", [
    (False, {"save_checkpoint": [StepFailed({1: "died"})]}),
    (True, {"wait_checkpoint": [None, StepFailed({1: "died"})]}),  # the wait before the save, then the run's end
], ids=["sync", "async"])
def test_a_rank_lost_in_a_stops_save_is_recovered_and_saved_without_training_further(tmp_path, async_save,
                                                                                    fail_calls):
    runtime = FakeRuntime(fail_calls=fail_calls)
    job = make_job(tmp_path, runtime=runtime, checkpoint={"every": 100, "memory_every": 1, "async": async_save})
    runtime.script[4] = lambda: job.request_stop("test")
    result = job.run()
    assert result.status == "stopped" and result.steps == 4 and len(result.losses) == 4
    assert [(r["source"], r["lost_steps"]) for r in result.recoveries] == [("memory", 0)]
    assert job.ckpt.complete_steps() == [4] and result.checkpoints == [str(job.ckpt.path_for(4))]


def test_status_shows_each_step_with_its_own_loss_while_that_step_saves(tmp_path, monkeypatch):
    """`raymesh status` reads the controller from another thread. The ranks save a step after its record reached
    the controller, so while step N saves, status shows step N with N's own loss (once it showed step N with
    N-1's loss, and step 1 with none, which a status poll saw)."""
    job = make_job(tmp_path, checkpoint={"every": 2, "memory_every": 1})
    seen, save = [], FakeGroup._save_checkpoint

    def saving(group, path: str, async_save: bool) -> None:
        status = job.status()
        seen.append((status["step"], status["loss"]))
        save(group, path, async_save)

    monkeypatch.setattr(FakeGroup, "_save_checkpoint", saving)
    job.run()
    assert seen == [(step, 1.0 / step) for step in (2, 4, 6, 8, 10)]  # the fake's loss is 1/step


def test_an_observer_told_of_a_step_finds_status_at_that_step_with_its_loss(tmp_path):
    """Observers hear of step N once the job shows it: a test gate (and a dashboard) holding the job in ``on_step``
    reads step N and N's loss, with the step's checkpoint saved (CI saw step N-1 from a gate at step N)."""
    job = make_job(tmp_path, checkpoint={"every": 2, "memory_every": 1})
    seen = []

    class Reader(JobObserver):
        def on_step(self, report) -> None:
            status = job.status()
            seen.append((report.record["step"], status["step"], status["loss"], report.record["loss"]))

    job.observers.add(Reader())
    job.run()
    assert [(s, shown) for s, shown, _, _ in seen] == [(s, s) for s in range(1, 11)]
    assert all(shown_loss == loss == 1.0 / s for s, _, shown_loss, loss in seen)  # the fake's loss is 1/step


def test_resuming_a_finished_run_refuses_and_changes_nothing(tmp_path):
    make_job(tmp_path, checkpoint={"every": 5, "memory_every": 1}).run()
    run_dir = tmp_path / "run"
    before = _contents(run_dir)
    job = make_job(tmp_path, checkpoint={"every": 5, "memory_every": 1})
    job.resume = True
    with pytest.raises(RunComplete, match=r"complete: .*step-00000010 is at step 10.*nothing was changed") as info:
        job.run()
    assert info.value.step == 10 and info.value.run_dir == run_dir
    assert job.machine.visited == [S.STARTING] and job.recorder.seen == []  # nothing started, nothing observed
    assert _contents(run_dir) == before


def _contents(run_dir):
    """Every file's bytes, except the run-dir lock's: its holder record (pid, since when, to the second) is rewritten
    by every controller that takes the lock, so comparing it made the test fail when a second ticked in between."""
    return {p: (b"" if p.name == "raymesh.lock" else p.read_bytes()) for p in run_dir.rglob("*") if p.is_file()}


def test_a_controller_restarted_after_the_final_save_writes_the_summary(tmp_path, monkeypatch):
    """The controller is lost after the last save, before summary.json: the restarted one finds the run complete
    and writes its summary from the run's step records and checkpoints, which its followers get too."""
    from orchestrator.observability.run_records import RunRecords
    from orchestrator.runtime.hosted import run_outcome

    lost = make_job(tmp_path, [kill(1, 7)], checkpoint={"every": 5, "memory_every": 3})  # step 7 trained twice
    with monkeypatch.context() as patched:
        patched.setattr(RunRecords, "write_summary", staticmethod(lambda run_dir, summary: lose_controller()))
        with pytest.raises(ControllerLost):
            lost.run()
    assert not (lost.run_dir / "summary.json").exists()
    restarted = make_job(tmp_path, checkpoint={"every": 5, "memory_every": 3})
    restarted.resume = True
    outcome = run_outcome(restarted, "job")
    summary = json.loads((lost.run_dir / "summary.json").read_text())
    assert outcome == {"summary": summary} and summary["status"] == "finished" and summary["steps"] == 10
    assert summary["losses"] == [1 / n for n in range(1, 11)] and summary["final_loss"] == 0.1
    assert summary["checkpoints"] == [str(lost.ckpt.path_for(s)) for s in (5, 10)]
    assert len(summary["grad_norms"]) == len(summary["step_time_s"]) == 10 and summary["tokens_per_s"] > 0


def test_a_controller_restarted_after_the_summary_hands_it_over_unchanged(tmp_path):
    from orchestrator.runtime.hosted import run_outcome

    finished = make_job(tmp_path, checkpoint={"every": 5, "memory_every": 1})
    finished.run()
    written = (finished.run_dir / "summary.json").read_text()
    restarted = make_job(tmp_path, checkpoint={"every": 5, "memory_every": 1})
    restarted.resume = True
    assert run_outcome(restarted, "job") == {"summary": json.loads(written)}
    assert (finished.run_dir / "summary.json").read_text() == written


def test_resuming_with_more_steps_than_the_checkpoint_trains_on(tmp_path):
    make_job(tmp_path, checkpoint={"every": 5, "memory_every": 1}).run()
    job = make_job(tmp_path, checkpoint={"every": 5, "memory_every": 1}, train={"steps": 12})
    job.resume = True
    result = job.run()
    assert result.resumed_from.endswith("step-00000010") and result.steps == 12 and len(result.losses) == 2


def test_a_stop_during_a_recovery_reads_stopping_and_ends_stopped(tmp_path):
    runtime = FakeRuntime()
    job = make_job(tmp_path, [kill(1, 5)], runtime=runtime)
    seen = {}
    real = job.changes.recover

    def recover(*args):
        job.request_stop("during recovery")
        seen["state"] = job.status()["state"]
        return real(*args)

    job.changes.recover = recover
    result = job.run()
    assert seen["state"] == "stopping" and result.status == "stopped"
    assert result.steps == 4 and len(result.losses) == 4  # the step restored; the failed one is not run again
    assert job.machine.visited == [S.STARTING, S.RUNNING, S.RECOVERING, S.STOPPING, S.STOPPED]


def test_every_step_checkpoints_are_sealed_and_observed(tmp_path):
    job = make_job(tmp_path, checkpoint={"every": 5, "memory_every": 0})
    result = job.run()
    assert len(result.checkpoints) == 2 and job.ckpt.complete_steps() == [5, 10]
    assert job.recorder.seen.count(("checkpoint", True)) == 2


# -- replacing failed ranks --------------------------------------------------------------


def test_the_run_records_observer_writes_a_step_line_per_completed_step_and_closes(tmp_path):
    job = make_job(tmp_path, [kill(1, 4)], checkpoint={"every": 0, "memory_every": 2})
    result = job.run()
    lines = [json.loads(line) for line in (job.run_dir / "steps.jsonl").read_text().splitlines()]
    # step 4 failed (no line); the rollback to the step-2 snapshot trains step 3 again, so it has two lines
    assert result.recoveries[0]["lost_steps"] == 1
    assert [r["step"] for r in lines] == [1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10]
    assert all(r["loss"] == result.losses[r["step"] - 1] for r in lines)
    assert all(o._steps.closed for o in job.observers.observers if hasattr(o, "_steps"))


def test_a_dead_rank_is_replaced_and_rolled_back_from_memory(tmp_path):
    job = make_job(tmp_path, [kill(1, 4)])
    result = job.run()
    assert actions(job) == [Action.REPLACE, Action.ROLL_BACK, Action.ROLL_BACK]
    assert job.changes.decisions[-1].source == "memory"
    (rec,) = result.recoveries
    assert list(rec) == RECOVERY_KEYS
    assert (rec["kind"], rec["rank"], rec["at_step"], rec["source"], rec["lost_steps"]) == ("rank", 1, 4, "memory", 0)
    assert job.machine.visited == [S.STARTING, S.RUNNING, S.RECOVERING, S.RUNNING, S.FINISHED]
    assert result.status == "finished" and result.steps == 10 and len(result.losses) == 10


def test_a_recovery_records_its_identities_phases_and_mttr(tmp_path):
    job = make_job(tmp_path, [kill(0, 3)])
    (rec,) = job.run().recoveries
    assert rec["identities_before"][0] == {"pid": 1000, "actor_id": "actor0", "node_id": "node0"}
    assert {"detect", "survivors", "replace", "form", "restore", "snapshot", "first_step"} == set(rec["phases_s"])
    assert rec["mttr_s"] >= 0 and ("recovery", "rank", 1, 0) in job.recorder.seen and ("mttr",) in job.recorder.seen


def test_only_the_dead_rank_is_replaced(tmp_path):
    runtime = FakeRuntime()
    make_job(tmp_path, [kill(1, 4)], runtime=runtime).run()
    assert runtime.groups[0].replaced == [{1}] and len(runtime.groups) == 1


def test_without_snapshots_the_rollback_is_from_the_latest_checkpoint(tmp_path):
    job = make_job(tmp_path, [kill(1, 5)], checkpoint={"every": 2, "memory_every": 0, "async": False})
    (rec,) = job.run().recoveries
    assert job.changes.decisions[-1].source == "disk"
    assert (rec["source"], rec["lost_steps"]) == ("disk", 0)


def test_without_snapshots_or_checkpoints_training_starts_over(tmp_path):
    job = make_job(tmp_path, [kill(1, 4)], checkpoint={"every": 0, "memory_every": 0})
    result = job.run()
    assert result.recoveries[0]["source"] == "initial" and result.recoveries[0]["lost_steps"] == 3
    assert result.steps == 10 and len(result.losses) == 10  # the lost steps' losses were cut back


def test_a_lost_snapshot_falls_back_to_disk(tmp_path):
    runtime = FakeRuntime(lose_snapshots=True)
    job = make_job(tmp_path, [kill(1, 5)], runtime=runtime, checkpoint={"every": 2, "memory_every": 1})
    (rec,) = job.run().recoveries
    assert [d.source for d in job.changes.decisions[-2:]] == ["memory", "disk"] and rec["source"] == "disk"


def repeated_steps(job) -> int:
    """How many ``steps.jsonl`` lines are steps trained again (a recovery's lost steps)."""
    lines = [json.loads(line)["step"] for line in (job.run_dir / "steps.jsonl").read_text().splitlines()]
    return len(lines) - len(set(lines))


@pytest.mark.parametrize("fault", ["kill_rank", "nan_loss"])
def test_a_checkpoint_newer_than_the_snapshot_is_restored_instead(tmp_path, fault):
    """Step 7 fails with the snapshot of step 5 and the checkpoint of step 6 at hand: the checkpoint loses no
    step, the snapshot one, so every rank loads the checkpoint (a NaN step too: step 6 was finite)."""
    job = make_job(tmp_path, [kill(1, 7, fault)], checkpoint={"every": 2, "memory_every": 5, "async": False})
    result = job.run()
    (rec,) = result.recoveries
    assert (rec["at_step"], rec["source"], rec["lost_steps"]) == (7, "disk", 0)
    assert job.changes.decisions[-1].source == "disk" and repeated_steps(job) == 0
    assert result.losses == [1 / n for n in range(1, 11)]


def test_a_snapshot_as_new_as_the_checkpoint_is_restored_from_memory(tmp_path):
    job = make_job(tmp_path, [kill(1, 7)], checkpoint={"every": 2, "memory_every": 3, "async": False})
    (rec,) = job.run().recoveries  # the snapshot of step 6 and the checkpoint of step 6: memory is faster
    assert (rec["source"], rec["lost_steps"]) == ("memory", 0)


def test_a_snapshot_older_than_hoped_gives_way_to_a_newer_checkpoint(tmp_path):
    """The snapshot of step 6 is not complete everywhere (a replica still in flight), so the restore goes back to
    step 5; the checkpoint of step 6 loses nothing, and is loaded after all."""
    runtime = FakeRuntime()
    job = make_job(tmp_path, [kill(1, 7)], runtime=runtime, checkpoint={"every": 2, "memory_every": 1,
                                                                        "async": False})
    runtime.script[7] = lambda: runtime.groups[0].snapshots.discard(6)
    result = job.run()
    (rec,) = result.recoveries
    assert (rec["source"], rec["lost_steps"]) == ("disk", 0) and repeated_steps(job) == 0
    assert [d.source for d in job.changes.decisions[-2:]] == ["memory", "disk"]


def test_a_corrupt_newer_checkpoint_leaves_the_snapshot_to_restore(tmp_path):
    """The checkpoint of step 6 is damaged: the good one (step 4) would lose two steps, the snapshot of step 5
    one, so the snapshot is restored."""
    job = make_job(tmp_path, [{"kind": "corrupt_checkpoint", "at_step": 7}, kill(1, 7)],
                   checkpoint={"every": 2, "memory_every": 5, "async": False})
    result = job.run()
    (rec,) = result.recoveries
    assert (rec["source"], rec["lost_steps"]) == ("memory", 1) and [c["step"] for c in job.ckpt.skipped] == [6]
    assert result.losses == [1 / n for n in range(1, 11)] and repeated_steps(job) == 1


def test_a_shrink_loads_a_checkpoint_newer_than_the_survivors_snapshots(tmp_path):
    job = make_job(tmp_path, [kill(1, 7)], runtime=FakeRuntime(placeable=False),
                   checkpoint={"every": 2, "memory_every": 5, "async": False})
    result = job.run()
    assert [(r["source"], r["at_step"], r["lost_steps"]) for r in result.resizes] == [("disk", 6, 0)]
    assert result.recoveries[0]["source"] == "disk" and repeated_steps(job) == 0


def test_a_rank_frozen_without_an_error_is_found_by_the_progress_deadline_and_replaced(tmp_path):
    """No record for the deadline (here the heartbeat timeout, 1 s, under the 5 s floor) is a hang: the group is
    asked which rank is stuck, it is replaced and training goes on from the snapshot, nothing lost."""
    runtime = FakeRuntime(stall={5: 1})
    job = make_job(tmp_path, runtime=runtime, fault_tolerance={"heartbeat_timeout_s": 1, "collective_timeout_s": 0.5})
    result = job.run()
    (rec,) = result.recoveries
    assert (rec["kind"], rec["rank"], rec["at_step"], rec["source"], rec["lost_steps"]) == ("hang", 1, 5, "memory", 0)
    assert 1.0 <= runtime.groups[0].hung_after < 5.0 and result.status == "finished" and result.steps == 10


def test_the_progress_deadline_is_three_typical_steps_at_least_the_floor_and_the_heartbeat_else(tmp_path):
    """A frozen rank is found within three typical steps (a few seconds' floor), not ten or 15 s (issue 51)."""
    job = make_job(tmp_path, fault_tolerance={"heartbeat_timeout_s": 120}, eval={"every": 5, "path": "/held"})
    acct = type("Acct", (), {"step_times": []})()
    assert job._deadline(acct) == 120  # no step yet: a first step may compile, load, warm up
    job._phase, acct.step_times = "step", [0.5] * 3 + [4.0] * 20
    assert job._deadline(acct) == 12.0  # three of the last twenty steps' median
    acct.step_times = [0.1] * 20
    assert job._deadline(acct) == 5.0  # the floor
    job.spec.fault_tolerance.hang_steps, job.spec.fault_tolerance.hang_floor_s = 10, 15.0
    assert job._deadline(acct) == 15.0  # both are the job file's
    job.step = 4  # step 5 evaluates: slower than any typical step
    assert job._deadline(acct) == 120
    job.step, job._phase = 1, "save"
    assert job._deadline(acct) == 120
    job._phase = "snapshot"  # an occasional snapshot runs before the next step: not a typical one
    assert job._deadline(acct) == 120


def test_a_hung_rank_is_a_hang_recovery(tmp_path):
    job = make_job(tmp_path, [kill(1, 4, "hang_rank")])
    assert job.run().recoveries[0]["kind"] == "hang"


def test_ranks_found_dead_when_the_failed_step_ends_are_replaced_too(tmp_path):
    runtime = FakeRuntime(more_dead={0: "died"})
    job = make_job(tmp_path, [kill(1, 4)], runtime=runtime)
    job.run()
    assert runtime.groups[0].replaced == [{1}, {0}] and job.restarts == 2


def test_restart_all_relaunches_the_whole_grid_from_disk(tmp_path):
    runtime = FakeRuntime()
    job = make_job(tmp_path, [kill(1, 5)], runtime=runtime, checkpoint={"every": 2, "memory_every": 1, "async": False},
                   fault_tolerance={"recovery": "restart_all"})
    (rec,) = job.run().recoveries
    assert actions(job) == [Action.RESTART_ALL]
    assert len(runtime.groups) == 2 and runtime.groups[0].stopped and runtime.placements[0].released
    assert (rec["source"], rec["lost_steps"]) == ("disk", 0)


def test_exceeding_the_restart_budget_gives_up_with_the_known_message(tmp_path):
    job = make_job(tmp_path, [kill(1, 3), kill(0, 5)], fault_tolerance={"max_restarts": 1})
    with pytest.raises(RuntimeError, match=r"rank 0 died at step 5: 2 rank restarts within 600 s "
                                           r"exceed fault_tolerance.max_restarts=1"):
        job.run()
    assert actions(job)[-1] is Action.GIVE_UP and job.state == "failed"
    assert job.machine.visited[-2:] == [S.RECOVERING, S.FAILED]


def test_a_step_saved_again_after_a_disk_rollback_is_listed_once(tmp_path):
    job = make_job(tmp_path, [{"kind": "corrupt_checkpoint", "at_step": 5}, kill(1, 5)],
                   checkpoint={"every": 2, "memory_every": 0, "async": False})
    result = job.run()  # step 4 corrupted, rolled back to 2, steps 3 and 4 run and saved again
    assert result.recoveries[0]["lost_steps"] == 2 and job.ckpt.skipped
    steps = [int(p.rsplit("-", 1)[1]) for p in result.checkpoints]
    assert sorted(steps) == [2, 4, 6, 8, 10] and len(steps) == len(set(steps))


def test_restarts_spread_over_more_than_the_window_never_exhaust_the_budget(tmp_path):
    now = [0.0]
    job = make_job(tmp_path, [kill(1, 3), kill(0, 5), kill(1, 7)], fault_tolerance={"max_restarts": 1})
    job.changes.window.clock = lambda: now.__setitem__(0, now[0] + 700.0) or now[0]  # each failure 700 s apart
    result = job.run()
    assert len(result.recoveries) == 3 and job.restarts == 3 and job.state == "finished"


# -- shrinking when replacements find no room --------------------------------------------


def test_unplaceable_replacements_shrink_dp_from_survivor_snapshots(tmp_path):
    runtime = FakeRuntime(placeable=False)
    job = make_job(tmp_path, [kill(1, 4)], runtime=runtime, train={"steps": 10, "global_batch_size": 8,
                                                                   "microbatches": 2})
    result = job.run()
    assert actions(job) == [Action.REPLACE, Action.SHRINK]
    (resize,) = result.resizes
    assert (resize["reason"], resize["dp_from"], resize["dp_to"], resize["source"]) == ("shrink", 2, 1, "memory")
    assert resize["microbatches"] == 4 and result.layout["dp"] == 1
    assert result.recoveries[0]["dp_to"] == 1 and ("layout", 1) in job.recorder.seen


def test_a_shrink_without_snapshots_loads_the_checkpoint(tmp_path):
    job = make_job(tmp_path, [kill(1, 5)], runtime=FakeRuntime(placeable=False),
                   checkpoint={"every": 2, "memory_every": 0})
    result = job.run()
    assert result.resizes[0]["source"] == "disk" and result.status == "finished"


# -- NaN losses --------------------------------------------------------------------------


def test_a_nan_loss_rolls_back_to_the_snapshot(tmp_path):
    job = make_job(tmp_path, [kill(0, 6, "nan_loss")])
    (rec,) = job.run().recoveries
    assert actions(job) == [Action.ROLL_BACK, Action.ROLL_BACK]
    assert (rec["kind"], rec["rank"], rec["source"]) == ("nan_loss", -1, "memory")


def test_a_nan_loss_without_a_snapshot_is_the_known_error(tmp_path):
    job = make_job(tmp_path, [kill(0, 6, "nan_loss")], checkpoint={"every": 2, "memory_every": 0})
    with pytest.raises(RuntimeError, match="non-finite loss and there is no in-memory snapshot") as err:
        job.run()
    assert str(err.value) == NAN_WITHOUT_SNAPSHOT and job.state == "failed"


# -- resizing ----------------------------------------------------------------------------


def test_a_scale_request_resizes_through_a_checkpoint(tmp_path):
    runtime = FakeRuntime()
    job = make_job(tmp_path, runtime=runtime)
    runtime.script[4] = lambda: job.request_scale(1)
    result = job.run()
    (resize,) = result.resizes
    assert (resize["reason"], resize["at_step"], resize["dp_from"], resize["dp_to"], resize["source"]) == \
           ("request", 4, 2, 1, "disk")
    assert job.machine.visited == [S.STARTING, S.RUNNING, S.RESIZING, S.RUNNING, S.FINISHED]
    assert result.steps == 10 and len(runtime.groups) == 2 and runtime.elastic_policy.target_dp == 1


def test_a_rank_lost_while_saving_for_a_resize_is_recovered_and_the_resize_done_after(tmp_path):
    runtime = FakeRuntime(fail_calls={"save_checkpoint": [StepFailed({1: "died"})]})
    job = make_job(tmp_path, runtime=runtime)
    runtime.script[4] = lambda: job.request_scale(1)
    result = job.run()
    assert [(r["kind"], r["source"]) for r in result.recoveries] == [("rank", "memory")]
    assert [(r["reason"], r["dp_to"]) for r in result.resizes] == [("request", 1)] and result.layout["dp"] == 1
    assert job.machine.visited == [S.STARTING, S.RUNNING, S.RESIZING, S.RECOVERING, S.RUNNING, S.RESIZING,
                                   S.RUNNING, S.FINISHED]
    assert result.status == "finished" and result.steps == 10


def test_a_resized_grid_that_cannot_form_falls_back_to_the_old_layout(tmp_path):
    runtime = FakeRuntime(fail_calls={"form": [None, StepFailed({0: "died"})]})  # start-up forms, the new grid not
    job = make_job(tmp_path, runtime=runtime)
    runtime.script[4] = lambda: job.request_scale(1)
    result = job.run()
    (resize,) = result.resizes
    assert (resize["dp_from"], resize["dp_to"], resize["source"]) == (2, 2, "disk")
    assert len(runtime.groups) == 3 and runtime.groups[1].stopped and runtime.placements[1].released
    assert result.status == "finished" and result.steps == 10 and result.layout["dp"] == 2


def test_growing_back_is_a_grow_resize(tmp_path):
    runtime = FakeRuntime()
    job = make_job(tmp_path, runtime=runtime, parallel={"dp": 1})
    runtime.script[3] = lambda: setattr(runtime.elastic_policy, "grow_to", 2)
    result = job.run()
    assert [(r["reason"], r["dp_to"]) for r in result.resizes] == [("grow", 2)]


def test_a_scale_to_an_impossible_layout_is_refused(tmp_path):
    job = make_job(tmp_path)
    with pytest.raises(ValueError):
        job.request_scale(3)  # the global batch of 8 does not split over 3 replicas


# -- the control surface -----------------------------------------------------------------


def test_an_injected_fault_outside_the_grid_names_the_ranks(tmp_path):
    job = make_job(tmp_path)
    with pytest.raises(ValueError, match="fix: pick a rank from 0 to 1"):
        job.inject_fault("kill_rank", 7, 2.0)


def test_an_injected_fault_hits_the_next_step(tmp_path):
    runtime = FakeRuntime()
    job = make_job(tmp_path, runtime=runtime)
    runtime.script[5] = lambda: job.inject_fault("kill_rank", 1, 2.0)
    result = job.run()
    assert [r["at_step"] for r in result.recoveries] == [6]


def test_status_reports_the_public_state_and_the_last_step(tmp_path):
    job = make_job(tmp_path)
    assert job.status()["state"] == "starting"
    job.run()
    status = job.status()
    assert status["state"] == "finished" and status["step"] == 10 and status["loss"] == pytest.approx(0.1)


@contextlib.contextmanager
def event_lines():
    """The event log's lines while the block runs."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("raymesh").addHandler(handler)
    try:
        yield lines
    finally:
        logging.getLogger("raymesh").removeHandler(handler)


def test_recoveries_and_resizes_are_event_lines(tmp_path):
    with event_lines() as lines:
        make_job(tmp_path, [kill(1, 4)], runtime=FakeRuntime(placeable=False)).run()
    resized = next(line for line in lines if line.startswith("event=resized"))
    assert resized == "event=resized reason=shrink dp_from=2 dp_to=1 step=3 source=memory microbatches=4"
    recovered = next(line for line in lines if line.startswith("event=recovered"))
    assert recovered.startswith("event=recovered kind=rank source=memory step=3 lost_steps=0 detect_s=")


# -- every failure class: raised steps, repeated NaN, lost replicas, foreign checkpoints ----


@pytest.mark.parametrize(("kind", "recorded"), [("raise_error", "error"), ("oom", "oom")])
def test_a_step_that_raises_replaces_the_rank_instead_of_failing_the_job(tmp_path, kind, recorded):
    runtime = FakeRuntime()
    job = make_job(tmp_path, [kill(1, 4, kind)], runtime=runtime)
    result = job.run()
    (rec,) = result.recoveries
    assert (rec["kind"], rec["rank"], rec["source"], rec["lost_steps"]) == (recorded, 1, "memory", 0)
    assert runtime.groups[0].replaced == [{1}] and result.status == "finished" and result.steps == 10


def test_a_nan_that_comes_back_at_the_same_step_skips_its_batch_and_says_so(tmp_path):
    job = make_job(tmp_path, runtime=FakeRuntime(nan_batches=frozenset({6})), fault_tolerance={"max_restarts": 5})
    with event_lines() as lines:
        result = job.run()
    assert [d.action for d in job.changes.decisions if d.action is not Action.ROLL_BACK] == [Action.SKIP_BATCH]
    assert job.changes.nan_times == {6: 2} and job.restarts == 2  # one re-run (nan_retries: 1), then skipped
    assert result.status == "finished" and all(loss == loss for loss in result.losses)  # no NaN recorded
    assert any(line.startswith("event=nan_batch_skipped step=6 times=2") for line in lines)


def test_two_bad_batches_in_a_row_are_both_skipped(tmp_path):
    """Batch 6 skipped, step 6 trains on batch 7, NaN as well: it is skipped too (step 6 then trains on batch 8),
    instead of the same NaN again until the restart budget ends the run."""
    runtime = FakeRuntime(nan_batches=frozenset({6, 7}))
    job = make_job(tmp_path, runtime=runtime, fault_tolerance={"max_restarts": 5})
    with event_lines() as lines:
        result = job.run()
    assert job.skip_batches == {6: 2} and runtime.groups[0].skipped_at[6] == 2
    assert result.status == "finished" and len(result.losses) == 10 and all(x == x for x in result.losses)
    assert any(line.startswith("event=nan_batch_skipped step=6 times=3 batches=2") for line in lines)


def resumed_after_loss(tmp_path, at_step: int, nan_batches: frozenset, **sections):
    """A job that skipped ``nan_batches`` and lost its controller before step ``at_step``, and its resume."""
    lost = make_job(tmp_path, runtime=FakeRuntime(nan_batches=nan_batches, script={at_step: lose_controller}),
                    **sections)
    with pytest.raises(ControllerLost):
        lost.run()
    resumed = make_job(tmp_path, runtime=FakeRuntime(nan_batches=nan_batches), **sections)
    resumed.resume = True
    return lost, resumed


SKIPPING = {"checkpoint": {"every": 4, "memory_every": 1, "async": False}, "fault_tolerance": {"max_restarts": 5}}


def test_a_resume_skips_the_batches_skipped_since_its_checkpoint(tmp_path):
    """Batch 6 was skipped (NaN twice at step 6), then the controller was lost at step 8: the resume from the
    checkpoint of step 4 skips batch 6 at step 6 again at once, instead of training it into NaN again."""
    lost, resumed = resumed_after_loss(tmp_path, 8, frozenset({6}), **SKIPPING)
    assert lost.skip_batches == {6: 1}
    result = resumed.run()
    assert result.resumed_from.endswith("step-00000004") and result.recoveries == []
    assert resumed.skip_batches == {6: 1} and resumed.runtime.groups[0].skipped_at[6] == 1
    assert result.losses == [1 / n for n in range(5, 11)]


def test_a_resume_from_a_checkpoint_after_the_skip_does_not_skip_again(tmp_path):
    """The checkpoint of step 8 holds the data position past batch 6 already: nothing more is skipped."""
    _, resumed = resumed_after_loss(tmp_path, 10, frozenset({6}), **SKIPPING)
    result = resumed.run()
    assert result.resumed_from.endswith("step-00000008") and result.recoveries == []
    assert [n for step, n in resumed.runtime.groups[0].skipped_at.items() if step > 8] == [0, 0]


def test_skipped_batches_that_cannot_be_recorded_are_logged_and_training_goes_on(tmp_path, monkeypatch):
    def disk_full(self, skips):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(CheckpointDir, "record_skipped_batches", disk_full)
    job = make_job(tmp_path, runtime=FakeRuntime(nan_batches=frozenset({6})), **SKIPPING)
    with event_lines() as lines:
        result = job.run()
    assert result.status == "finished" and job.skip_batches == {6: 1}
    assert any(line.startswith("event=skipped_batches_not_recorded") and "No space left" in line for line in lines)


def test_a_fresh_run_forgets_the_batches_an_earlier_run_skipped(tmp_path):
    make_job(tmp_path, runtime=FakeRuntime(nan_batches=frozenset({6}))).run()  # no checkpoints: not refused
    fresh = make_job(tmp_path)
    fresh.run()
    assert fresh.ckpt.skipped_batches() == {}


def test_a_repeated_nan_stops_with_the_step_when_asked_to(tmp_path):
    job = make_job(tmp_path, runtime=FakeRuntime(nan_batches=frozenset({6})),
                   fault_tolerance={"on_repeated_nan": "stop", "nan_retries": 2, "max_restarts": 5})
    with pytest.raises(RuntimeError, match=r"step 6 produced a non-finite loss 3 times .* fix: lower optim.lr"):
        job.run()
    assert job.changes.nan_times == {6: 3} and job.state == "failed"


def test_nan_rollbacks_count_against_the_restart_budget(tmp_path):
    job = make_job(tmp_path, runtime=FakeRuntime(nan_batches=frozenset({3, 5, 7})),
                   fault_tolerance={"max_restarts": 2, "nan_retries": 0})
    with pytest.raises(RuntimeError, match="3 rank restarts within 600 s exceed fault_tolerance.max_restarts=2"):
        job.run()


def test_a_fresh_run_into_another_runs_checkpoints_is_refused_before_any_rank_starts(tmp_path):
    runtime = FakeRuntime()
    first = make_job(tmp_path, checkpoint={"every": 5, "memory_every": 1}, runtime=runtime)
    first.run()
    again = make_job(tmp_path, checkpoint={"every": 5, "memory_every": 1}, runtime=runtime)
    with pytest.raises(SpecError, match=r"`run_dir`.*holds checkpoints of another run .*2 sealed: step-00000005, "
                                        r"step-00000010; fix: .*--resume.*another run_dir.*delete those folders"):
        again.run()
    assert len(runtime.groups) == 1  # nothing was started for the refused run
    assert first.ckpt.complete_steps() == [5, 10]


def test_retention_never_deletes_the_checkpoint_just_saved_for_higher_foreign_steps(tmp_path):
    directory = CheckpointDir(tmp_path / "ckpt", keep=2)
    for step in (40, 50, 60, 2, 4, 6):  # an old run's steps 40-60, then this run's 2, 4, 6
        directory.path_for(step).mkdir(parents=True)
        (directory.path_for(step) / ".metadata").write_text("x")
        directory.seal(step)
        directory.prune(step)
    assert directory.complete_steps() == [4, 6, 50, 60]  # this run keeps its newest two; the old run is untouched


def test_a_rank_lost_with_its_replica_falls_back_to_the_checkpoint_and_names_the_lost_steps(tmp_path):
    runtime = FakeRuntime(lose_snapshots=True)  # what restore answers when a rank's holder died with it
    job = make_job(tmp_path, [kill(1, 7)], runtime=runtime, checkpoint={"every": 4, "memory_every": 1, "async": False})
    with event_lines() as lines:
        (rec,) = job.run().recoveries
    assert (rec["source"], rec["lost_steps"]) == ("disk", 2)
    assert any(line.startswith("event=rolled_back_to_checkpoint step=4 lost_steps=5-6") for line in lines)


def test_without_any_checkpoint_starting_over_is_said_loudly(tmp_path):
    job = make_job(tmp_path, [kill(1, 4)], runtime=FakeRuntime(lose_snapshots=True),
                   checkpoint={"every": 0, "memory_every": 1})
    with event_lines() as lines:
        (rec,) = job.run().recoveries
    assert (rec["source"], rec["lost_steps"]) == ("initial", 3)
    said = 'event=no_checkpoint lost_steps=1-3 action="STARTING OVER FROM STEP 0'
    assert any(line.startswith(said) for line in lines)


def sealed(directory: CheckpointDir, step: int) -> Path:
    """A complete checkpoint of ``step`` in ``directory`` (DCP's metadata and a shard, sealed)."""
    unsealed(directory.path_for(step))
    directory.seal(step)
    return directory.path_for(step)


def unsealed(path: Path) -> Path:
    """A checkpoint folder holding DCP's metadata and a shard but no manifest (a copy that dropped ``*.json``)."""
    path.mkdir(parents=True)
    (path / ".metadata").write_text(json.dumps({"step": int(path.name[5:13]), "skipped": 0}))
    (path / "__0_0.distcp").write_bytes(bytes(64))
    return path


def flip(checkpoint: Path) -> None:
    """Damage a checkpoint's shard so that only its checksum tells."""
    shard = checkpoint / "__0_0.distcp"
    shard.write_bytes(bytes(b ^ 0xFF for b in shard.read_bytes()))


def test_only_a_save_this_process_started_is_removed_as_incomplete_and_nothing_set_aside_is_removed(tmp_path):
    directory = CheckpointDir(tmp_path / "ckpt", keep=2)
    for step in (2, 6):
        sealed(directory, step)
    directory.begin(4)  # this process's save of step 4, which never completed
    foreign = unsealed(directory.path_for(5))  # every shard, no manifest: not this process's to delete
    unsealed(directory.path_for(1).with_name("step-00000001.corrupt"))  # older than every kept one: still kept
    with event_lines() as lines:
        assert directory.remove_leftovers() == [directory.path_for(4)]
        assert directory.set_aside_unsealed() == [foreign.with_name("step-00000005.unsealed")]
    assert sorted(p.name for p in directory.root.iterdir()) == ["step-00000001.corrupt", "step-00000002",
                                                                 "step-00000005.unsealed", "step-00000006"]
    assert (directory.root / "step-00000005.unsealed" / "__0_0.distcp").is_file()
    assert any(line.startswith(f"event=checkpoint_set_aside path={foreign} moved_to={foreign}.unsealed")
               and "no manifest" in line for line in lines)
    assert sum(line.startswith("event=checkpoint_removed") for line in lines) == 1


def test_a_checkpoint_found_corrupt_twice_keeps_both_set_aside_copies(tmp_path):
    directory = CheckpointDir(tmp_path / "ckpt", keep=3)
    for _ in range(2):
        flip(sealed(directory, 10))
        assert directory.latest_verified("resume") is None
    first, second = (Path(s["path"]) for s in directory.skipped)
    assert first.name == "step-00000010.corrupt" and second.name.startswith("step-00000010.corrupt-")
    assert (first / ".metadata").is_file() and (second / ".metadata").is_file()


@pytest.mark.parametrize("async_save, fail_calls", [
    (False, {"save_checkpoint": [RuntimeError("No space left on device")]}),
    # the rank's write fails after the save call returned: the wait that finds it is the poll after step 5
    (True, {"wait_checkpoint": [None, OSError("[Errno 28] No space left on device")]}),
], ids=["sync", "async-in-the-background"])
def test_a_save_that_fails_is_logged_and_the_next_save_goes_on(tmp_path, async_save, fail_calls):
    runtime = FakeRuntime(fail_calls=fail_calls)
    job = make_job(tmp_path, runtime=runtime, checkpoint={"every": 4, "memory_every": 1, "async": async_save})
    with event_lines() as lines:
        result = job.run()
    assert result.status == "finished" and job.ckpt.complete_steps() == [8, 10]  # step 4's save failed
    assert any(line.startswith("event=checkpoint_failed step=4") and "No space left" in line for line in lines)


def test_a_last_async_save_that_fails_is_saved_again_before_the_run_ends(tmp_path):
    """No later save would retry it: the run's end saves its last step again, synchronously."""
    # waits: the saves of steps 4, 8 and 10 (none in flight), the polls after 5 and 9, then the run's end
    failure = OSError("[Errno 5] Input/output error")
    runtime = FakeRuntime(fail_calls={"wait_checkpoint": [None] * 5 + [failure]})
    job = make_job(tmp_path, runtime=runtime, checkpoint={"every": 4, "memory_every": 1, "async": True})
    with event_lines() as lines:
        result = job.run()
    assert result.status == "finished" and job.ckpt.complete_steps() == [4, 8, 10]
    assert any(line.startswith("event=checkpoint_failed step=10") and "Input/output" in line
               and "saving it again" in line for line in lines)
    assert result.checkpoints[-1] == str(job.ckpt.path_for(10))


def test_a_last_save_that_fails_is_made_again_before_the_run_ends(tmp_path):
    runtime = FakeRuntime(fail_calls={"save_checkpoint": [None, None, RuntimeError("No space left on device")]})
    job = make_job(tmp_path, runtime=runtime, checkpoint={"every": 4, "memory_every": 1, "async": False})
    assert job.run().checkpoints[-1] == str(job.ckpt.path_for(10)) and job.ckpt.complete_steps() == [4, 8, 10]


def test_a_rank_lost_while_saving_is_recovered_like_a_failed_step(tmp_path):
    runtime = FakeRuntime(fail_calls={"save_checkpoint": [StepFailed({1: "died"})]})
    job = make_job(tmp_path, runtime=runtime, checkpoint={"every": 4, "memory_every": 1, "async": False})
    result = job.run()
    (rec,) = result.recoveries
    assert (rec["kind"], rec["rank"], rec["source"]) == ("rank", 1, "memory")
    assert result.status == "finished" and len(result.losses) == 10 and job.ckpt.complete_steps() == [8, 10]


def test_a_rank_lost_during_a_recovery_starts_the_recovery_again(tmp_path):
    runtime = FakeRuntime(fail_calls={"form": [StepFailed({0: "died"})]})  # the first re-form after the fault
    job = make_job(tmp_path, [kill(1, 4)], runtime=runtime)
    runtime.fail_calls["form"].insert(0, None)  # the start-up form succeeds
    result = job.run()
    assert runtime.groups[0].replaced == [{1}, {0}] and job.restarts == 2
    assert result.recoveries[0]["source"] == "memory" and result.status == "finished" and len(result.losses) == 10


class Endless(BaseException):
    """A retry loop that does not end (a ``BaseException``: no recovery path may catch it)."""


def test_a_recovery_failing_again_and_again_gives_up_after_max_restarts_attempts_in_a_row(tmp_path):
    """Every re-form hangs as long as the restart window: the restarts leave the window as fast as they come, so
    only the cap on failed attempts in a row (max_restarts, with no step completed) ends the retries."""
    now = [0.0]

    class Hangs(list):  # the start-up form succeeds; each re-form fails after the real group's wait for a hung rank
        def pop(self, i=0):
            self.append(None)
            if len(self) == 1:
                return None
            if len(self) > 100:  # still retrying: end the test instead of looping forever
                raise Endless
            now[0] += 600.0
            return StepFailed({1: "hung"})

        def __bool__(self):
            return True

    runtime = FakeRuntime()
    runtime.fail_calls["form"] = Hangs()
    job = make_job(tmp_path, [kill(1, 4)], runtime=runtime, fault_tolerance={"max_restarts": 5})
    job.changes.window.clock = lambda: now[0]
    with pytest.raises(RuntimeError, match=r"failed 5 times in a row.*rank 1 hung.*raise fault_tolerance.max_restarts"):
        job.run()
    assert len(runtime.groups[0].replaced) == 5 and job.changes.decisions[-1].action is Action.GIVE_UP
    assert job.state == "failed"


def test_failed_recoveries_in_a_row_start_over_after_a_completed_step(tmp_path):
    """Two failed attempts, a completed step, two more: under a cap of 3 in a row the run goes on."""
    runtime = FakeRuntime(fail_calls={"form": [None, StepFailed({0: "died"}), StepFailed({0: "died"}), None,
                                               StepFailed({0: "died"}), StepFailed({0: "died"})]})
    job = make_job(tmp_path, [kill(1, 4), kill(1, 6)], runtime=runtime, fault_tolerance={"max_restarts": 3})
    hours = iter(range(0, 10**6, 3600))  # every restart an hour after the last: only the in-a-row cap can trip
    job.changes.window.clock = lambda: float(next(hours))
    result = job.run()
    assert result.status == "finished" and len(result.losses) == 10 and job.changes.failed_in_a_row == 0


def test_a_rank_lost_waiting_for_the_last_async_save_is_recovered_and_the_save_made_again(tmp_path):
    """wait_checkpoint calls: the saves of 4 and 8, the polls after 5 and 9, the save of 10, then the run's end,
    where rank 1 is lost: recovered like the same loss mid-run, and step 10 is saved again."""
    runtime = FakeRuntime(fail_calls={"wait_checkpoint": [None] * 5 + [StepFailed({1: "died"})]})
    job = make_job(tmp_path, runtime=runtime, checkpoint={"every": 4, "memory_every": 1, "async": True})
    result = job.run()
    assert result.status == "finished" and result.steps == 10 and len(result.losses) == 10
    assert [(r["at_step"], r["source"], r["lost_steps"]) for r in result.recoveries] == [(10, "memory", 0)]
    assert job.ckpt.complete_steps()[-1] == 10 and runtime.groups[0].replaced == [{1}]


def test_a_rank_lost_while_a_resume_loads_is_recovered(tmp_path):
    make_job(tmp_path, checkpoint={"every": 5, "memory_every": 1}).run()
    runtime = FakeRuntime(fail_calls={"load_checkpoint": [StepFailed({1: "died"})]})
    job = make_job(tmp_path, runtime=runtime, checkpoint={"every": 5, "memory_every": 1}, train={"steps": 12})
    job.resume = True
    result = job.run()
    assert result.status == "finished" and result.steps == 12 and result.resumed_from.endswith("step-00000010")
    assert [(r["kind"], r["at_step"], r["source"], r["lost_steps"]) for r in result.recoveries] == [
        ("rank", 11, "disk", 0)]
    assert runtime.groups[0].replaced == [{1}] and result.losses == [1 / 11, 1 / 12]


def test_two_recoveries_with_no_step_between_them_are_both_recorded(tmp_path):
    """Step 5 fails (rolled back to the snapshot of 3, step 4 lost), then step 4 fails as it is run again: both
    recoveries are in the result and the summary, and their lost steps add up to the repeated steps.jsonl lines."""
    runtime = FakeRuntime()
    job = make_job(tmp_path, runtime=runtime, checkpoint={"every": 0, "memory_every": 3})

    def fail_now():
        raise StepFailed({1: "died"})

    runtime.script[5] = lambda: (runtime.script.__setitem__(4, fail_now), fail_now())
    result = job.run()
    assert [(r["at_step"], r["lost_steps"]) for r in result.recoveries] == [(5, 1), (4, 0)]
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert [(r["at_step"], r["lost_steps"]) for r in summary["recoveries"]] == [(5, 1), (4, 0)]
    lines = [json.loads(line)["step"] for line in (job.run_dir / "steps.jsonl").read_text().splitlines()]
    assert len(lines) - 10 == sum(r["lost_steps"] for r in result.recoveries) == 1


def test_a_save_cut_short_is_saved_again_when_the_recovery_is_retried(tmp_path):
    """Step 5 fails while the async save of 4 is in flight; the first re-form loses rank 0 too. The retried
    recovery restores step 4 and still saves it again, or the run would have no checkpoint of step 4."""
    runtime = FakeRuntime(fail_calls={"form": [None, StepFailed({0: "died"})]})
    job = make_job(tmp_path, [kill(1, 5)], runtime=runtime,
                   checkpoint={"every": 4, "memory_every": 1, "async": True})
    result = job.run()
    assert result.status == "finished" and runtime.groups[0].replaced == [{1}, {0}]
    assert str(job.ckpt.path_for(4)) in result.checkpoints and 4 in job.ckpt.complete_steps()


def test_a_resize_whose_save_fails_its_checksums_goes_back_and_says_so(tmp_path, monkeypatch):
    """The resize's save (step 5) is damaged before the new grid loads it: the load falls back to step 4, the
    record says one step is trained again, and the account is cut back (each step reported once)."""
    from orchestrator.faults.disk import corrupt_newest
    from orchestrator.runtime.grid_changes import GridChanges

    runtime = FakeRuntime()
    job = make_job(tmp_path, runtime=runtime, checkpoint={"every": 2, "memory_every": 1, "async": False})
    runtime.script[5] = lambda: job.request_scale(1)
    real = GridChanges._relaunch

    def relaunch(self, target, old):
        corrupt_newest(self.job.ckpt)
        return real(self, target, old)

    monkeypatch.setattr(GridChanges, "_relaunch", relaunch)
    result = job.run()
    assert result.losses == [1 / n for n in range(1, 11)]
    assert [(r["at_step"], r["source"], r["lost_steps"]) for r in result.resizes] == [(4, "disk", 1)]
    lines = [json.loads(line)["step"] for line in (job.run_dir / "steps.jsonl").read_text().splitlines()]
    assert len(lines) - 10 == 1 and sorted(set(lines)) == list(range(1, 11))


def test_a_rank_lost_while_the_resized_grid_loads_keeps_the_resize_record(tmp_path):
    """The relaunched grid (dp 1) loses a rank while loading the resize's checkpoint: the resize is recorded and
    observed, then the rank is recovered at the new dp from that checkpoint, nothing lost."""
    runtime = FakeRuntime(fail_calls={"load_checkpoint": [StepFailed({0: "died"})]})
    job = make_job(tmp_path, runtime=runtime)
    runtime.script[4] = lambda: job.request_scale(1)
    result = job.run()
    assert result.status == "finished" and result.layout["dp"] == 1 and len(result.losses) == 10
    assert [(r["reason"], r["dp_from"], r["dp_to"], r["at_step"]) for r in result.resizes] == [("request", 2, 1, 4)]
    assert ("layout", 1) in job.recorder.seen
    assert [(r["kind"], r["dp_from"], r["dp_to"], r["source"], r["lost_steps"]) for r in result.recoveries] == [
        ("rank", 1, 1, "disk", 0)]


def test_two_ranks_failing_at_once_are_replaced_in_one_recovery(tmp_path):
    runtime = FakeRuntime()
    job = make_job(tmp_path, [kill(0, 4), kill(1, 4, "oom")], runtime=runtime, parallel={"dp": 4})
    (rec,) = job.run().recoveries
    assert runtime.groups[0].replaced == [{0, 1}] and job.restarts == 2 and rec["source"] == "memory"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chaos_a_seeded_random_schedule_of_every_fault_kind_loses_nothing_silently(tmp_path, seed):
    """Controller invariants under a random mix of faults (the real ranks' side is in the integration tests):
    the run finishes every step with the uninterrupted losses, and every step trained again is one a
    recovery reported as lost (steps.jsonl has exactly that many repeated lines)."""
    import random

    rng = random.Random(seed)
    kinds = ["kill_rank", "kill_node", "hang_rank", "nan_loss", "raise_error", "oom", "corrupt_checkpoint"]
    steps = rng.sample(range(2, 30), 8)
    faults = [{"kind": rng.choice(kinds), "rank": rng.randrange(4), "at_step": s} for s in steps]
    job = make_job(tmp_path, faults, parallel={"dp": 4}, train={"steps": 30, "global_batch_size": 8},
                   checkpoint={"every": 5, "memory_every": rng.choice([1, 3]), "async": rng.random() < 0.5},
                   fault_tolerance={"max_restarts": 50})
    result = job.run()
    assert result.status == "finished" and result.losses == [1.0 / n for n in range(1, 31)]
    lines = [json.loads(line)["step"] for line in (job.run_dir / "steps.jsonl").read_text().splitlines()]
    assert sorted(set(lines)) == list(range(1, 31))
    assert len(lines) - 30 == sum(r["lost_steps"] for r in result.recoveries)
    rank_faults = [f for f in faults if f["kind"] != "corrupt_checkpoint"]
    assert len(result.recoveries) == len(rank_faults)


# -- checkpoint folders nobody asked to lose, resumes that would start over, a last save that failed ------------

EVERY_5 = {"every": 5, "memory_every": 1}


def resumed(tmp_path, steps: int = 15, runtime=None, **checkpoint):
    """The job of ``tmp_path`` continued with ``--resume`` to ``steps``."""
    job = make_job(tmp_path, runtime=runtime, checkpoint={**EVERY_5, **checkpoint}, train={"steps": steps})
    job.resume = True
    return job


def test_a_resume_sets_aside_a_newest_checkpoint_without_its_manifest_instead_of_deleting_it(tmp_path):
    """A copy that filtered ``*.json`` holds every shard and DCP's metadata: resume passes it over, never deletes."""
    first = make_job(tmp_path, checkpoint=EVERY_5)
    first.run()
    newest = first.ckpt.path_for(10)
    (newest / checksums.MANIFEST).unlink()
    job = resumed(tmp_path)
    with event_lines() as lines:
        result = job.run()
    assert result.resumed_from == str(first.ckpt.path_for(5)) and result.status == "finished"
    aside = newest.with_name("step-00000010.unsealed")
    assert (aside / ".metadata").is_file() and (aside / "__0_0.distcp").is_file()
    assert job.ckpt.complete_steps() == [5, 10, 15]  # step 10 saved again beside it
    assert any(line.startswith(f"event=checkpoint_set_aside path={newest} moved_to={aside}") and "no manifest"
               in line for line in lines)


@pytest.mark.parametrize("name", ["step-00000004", "step-00000004.corrupt"])
def test_a_fresh_run_beside_any_checkpoint_folder_is_refused_before_any_rank_starts(tmp_path, name):
    folder = unsealed(tmp_path / "run" / "checkpoints" / name)
    runtime = FakeRuntime()
    kind = "unsealed \\(no manifest\\)" if name == "step-00000004" else "set aside"
    with pytest.raises(SpecError, match=rf"`run_dir`.* holds checkpoints of another run in .*checkpoints: 1 {kind}: "
                                        rf"{name}; fix: .*--resume.*another run_dir.*delete those folders"):
        make_job(tmp_path, runtime=runtime, checkpoint=EVERY_5).run()
    assert runtime.groups == [] and (folder / "__0_0.distcp").is_file()


def test_a_failed_save_of_this_run_is_removed_and_a_folder_it_did_not_write_is_left_alone(tmp_path):
    runtime = FakeRuntime(fail_calls={"save_checkpoint": [OSError(errno.ENOSPC, "No space left on device")]})
    job = make_job(tmp_path, runtime=runtime, checkpoint={"every": 4, "memory_every": 1, "async": False})
    runtime.script[6] = lambda: unsealed(job.ckpt.path_for(5))  # appears mid-run: not this run's to delete
    with event_lines() as lines:
        job.run()
    assert job.ckpt.complete_steps() == [8, 10] and not job.ckpt.path_for(4).exists()
    assert any(line.startswith(f"event=checkpoint_removed path={job.ckpt.path_for(4)}") for line in lines)
    assert (job.ckpt.path_for(5) / "__0_0.distcp").is_file()


def test_checkpoints_set_aside_as_corrupt_are_never_pruned(tmp_path):
    first = make_job(tmp_path, checkpoint={**EVERY_5, "keep": 2})
    first.run()
    flip(first.ckpt.path_for(10))
    job = resumed(tmp_path, steps=25, keep=2)
    result = job.run()
    assert result.resumed_from == str(first.ckpt.path_for(5)) and job.ckpt.complete_steps() == [20, 25]
    assert (job.ckpt.root / "step-00000010.corrupt" / "__0_0.distcp").is_file()  # older than every kept one


def test_a_resume_of_a_job_that_never_saved_is_refused_before_any_rank_starts(tmp_path):
    runtime = FakeRuntime()
    with pytest.raises(SpecError, match=r"option `--resume`: value '.*checkpoints' finds no checkpoint: the job "
                                        r"never saved one \(the directory does not exist\), so there is nothing to "
                                        r"resume from; fix: to start over, run without --resume"):
        resumed(tmp_path, runtime=runtime).run()
    assert runtime.groups == []


def test_a_resume_where_every_checkpoint_fails_its_checksums_is_refused_and_keeps_them(tmp_path):
    first = make_job(tmp_path, checkpoint=EVERY_5)
    first.run()
    for step in (5, 10):
        flip(first.ckpt.path_for(step))
    with pytest.raises(SpecError, match=r"`--resume`.* finds 2 checkpoints, all failing their checksums .*: "
                                        r"step-00000010.corrupt \(__0_0.distcp fails its CRC-32 check\), "
                                        r"step-00000005.corrupt .*fix: .*without --resume into a fresh run_dir"):
        resumed(tmp_path).run()
    for step in (5, 10):
        assert (first.ckpt.root / f"step-{step:08d}.corrupt" / "__0_0.distcp").is_file()


def test_a_restarted_controller_of_a_run_that_never_saved_starts_over_but_not_over_corrupt_checkpoints(tmp_path):
    """Ray restarts a lost hosted controller with resume on: where its first life never saved, it starts over
    (said), as it always has; where checkpoints exist and none loads, it is refused like a user's --resume."""
    job = resumed(tmp_path, steps=10)
    job.restarted = True
    with event_lines() as lines:
        result = job.run()
    assert result.resumed_from is None and result.status == "finished" and len(result.losses) == 10
    assert any(line.startswith("event=resume found=none") for line in lines)
    for step in (5, 10):
        flip(job.ckpt.path_for(step))
    again = resumed(tmp_path, steps=10)
    again.restarted = True
    with pytest.raises(SpecError, match="all failing their checksums"):
        again.run()


def nospace() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("saves_that_work, on_disk, not_kept", [(2, 8, "9-10"), (0, None, "1-10")],
                         ids=["the-last-fails", "every-save-fails"])
def test_a_last_save_that_fails_fails_the_run_and_says_what_is_not_kept(tmp_path, saves_that_work, on_disk,
                                                                         not_kept):
    """Saves of steps 4, 8, 10, then the run's end saves step 10 again: that last one fails too."""
    runtime = FakeRuntime(fail_calls={"save_checkpoint": [None] * saves_that_work + [nospace()] * 4})
    job = make_job(tmp_path, runtime=runtime, checkpoint={"every": 4, "memory_every": 1, "async": False})
    with event_lines() as lines:
        result = job.run()
    failure = {"step": 10, "reason": "[Errno 28] No space left on device", "last_on_disk": on_disk,
               "last_checkpoint": str(job.ckpt.path_for(on_disk)) if on_disk else None, "steps_not_kept": not_kept}
    assert result.status == "failed" and job.state == "failed" and result.checkpoint_failure == failure
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["checkpoint_failure"] == failure
    finish = next(line for line in lines if line.startswith("event=finish"))
    assert "status=failed steps=10" in finish and f"not_kept={not_kept}" in finish and "No space left" in finish
    assert not job.ckpt.path_for(10).exists()  # what the failed saves left is removed: it frees their space


def test_a_failed_saves_reason_is_the_ranks_own_error_not_rays_wrapper(tmp_path):
    """In a window the rank's own error reaches the record; a save the controller makes between windows (here the
    last step's again, after its save in the window failed) fails inside Ray's wrapper, which is taken off."""
    said = "saving the checkpoint /ckpt/step-00000010 failed: rank 1: [Errno 28] No space left on device"
    wrapped = RayTaskError("RankWorker.save_checkpoint", "Traceback (most recent call last):\n...", OSError(said),
                           proctitle="ray::RankWorker.save_checkpoint()", pid=12, ip="10.0.0.1",
                           actor_repr="<workers.rank_worker.RankWorker object at 0x7f00>").as_instanceof_cause()
    runtime = FakeRuntime(fail_calls={"save_checkpoint": [None, None, OSError(said), wrapped]})
    job = make_job(tmp_path, runtime=runtime, checkpoint={"every": 4, "memory_every": 1, "async": False})
    with event_lines() as lines:
        result = job.run()
    in_window, again = [line for line in lines if line.startswith("event=checkpoint_failed")]
    assert f'reason="rank 0: {said}"' in in_window and "saving it again" in in_window
    assert f'reason="{said}"' in again and "RankWorker object" not in again and result.status == "failed"


@contextlib.contextmanager
def umask(mask: int):
    before = os.umask(mask)
    try:
        yield
    finally:
        os.umask(before)


@pytest.mark.parametrize("permissions, dirs, files", [(None, 0o700, 0o600), ("group", 0o750, 0o640),
                                                      ("umask", 0o755, 0o644)], ids=["default", "group", "umask"])
def test_checkpoints_are_private_to_the_user_unless_the_job_says(tmp_path, permissions, dirs, files):
    """The ranks write under a umask of 022 (world-readable); a checkpoint's folders and files get the job's
    checkpoint.permissions (default private) before the seal, the run dir and checkpoint root as they are made."""
    chosen = {"permissions": permissions} if permissions else {}
    with umask(0o022):
        job = make_job(tmp_path, checkpoint={**EVERY_5, **chosen})
        job.run()
    modes = {p.relative_to(job.run_dir): stat.S_IMODE(p.stat().st_mode)
             for p in [job.run_dir, *job.run_dir.rglob("*")] if "step-" in p.as_posix() or p.is_dir()}
    assert {str(p) for p in modes} >= {".", "checkpoints", "checkpoints/step-00000010/__0_0.distcp",
                                       f"checkpoints/step-00000010/{checksums.MANIFEST}"}
    assert {p: m for p, m in modes.items() if m != (dirs if (job.run_dir / p).is_dir() else files)} == {}


def test_a_checkpoint_permissions_value_that_is_not_one_is_refused_naming_the_field(tmp_path):
    with pytest.raises(SpecError, match=r"`checkpoint.permissions`: value 'world' .*private, group, umask"):
        make_job(tmp_path, checkpoint={"permissions": "world"})
