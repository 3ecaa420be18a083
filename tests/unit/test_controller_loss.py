"""A hosted controller's own loss, recovered from like any other (no Ray: the fake rank group).

Ray restarts a lost controller actor and the new life resumes from the run dir's checkpoints
(``orchestrator/runtime/hosted.py``). Its life appends to ``steps.jsonl`` (never starts it over), the summary
records the loss (kind ``controller``: at which step, the steps lost, the MTTR from the lost life's last record to
the new life's first step) and the goodput counts the gap as lost. When Ray gives up restarting it, the follower
stops waiting at once and writes the run's summary from its records (status failed).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from orchestrator.cli import follow
from orchestrator.observability.run_records import LIVES, controller_losses, lost_run_summary, read_jsonl
from tests.support.controller_jobs import make_job
from tests.support.fake_group import FakeRuntime

GAP_S = 1000.0  # the lost life's records are moved this far into the past: a gap no test run could time itself


class ControllerLost(BaseException):
    """The controller's process dies mid-run."""


def lose_controller():
    raise ControllerLost


def lost_at(tmp_path, step: int, **sections):
    """A job whose controller is lost before ``step`` (it trained the steps before it), its records then moved
    ``GAP_S`` into the past; returns the job."""
    lost = make_job(tmp_path, runtime=FakeRuntime(script={step: lose_controller}), **sections)
    with pytest.raises(ControllerLost):
        lost.run()
    for name, key in (("steps.jsonl", "time"), (LIVES, "started")):
        path = lost.run_dir / name
        path.write_text("".join(json.dumps({**r, key: r[key] - GAP_S}) + "\n" for r in read_jsonl(path)))
    return lost


def restarted(tmp_path, **sections):
    """The job's life after Ray restarted its controller (``ControllerActor``: ``was_current_actor_reconstructed``)."""
    job = make_job(tmp_path, **sections)
    job.resume = job.restarted = True
    return job


def steps_recorded(job) -> list[int]:
    return [r["step"] for r in read_jsonl(job.run_dir / "steps.jsonl")]


CHECKPOINTED = {"checkpoint": {"every": 5, "memory_every": 1}}


def test_a_restarted_controller_appends_its_steps_and_records_its_own_loss(tmp_path):
    lost_at(tmp_path, 8, **CHECKPOINTED)  # trained 1..7, checkpoint at 5
    job = restarted(tmp_path, **CHECKPOINTED)
    result = job.run()
    assert steps_recorded(job) == [1, 2, 3, 4, 5, 6, 7, 6, 7, 8, 9, 10]
    [loss] = result.recoveries
    assert {k: loss[k] for k in ("kind", "rank", "at_step", "lost_steps", "source")} == {
        "kind": "controller", "rank": -1, "at_step": 6, "lost_steps": 2, "source": "disk"}
    assert loss["mttr_s"] >= GAP_S and set(loss["phases_s"]) == {"restart", "first_step"}
    assert ("recovery", "controller", 0, 2) in job.recorder.seen
    assert result.goodput < sum(result.step_time_s) / GAP_S + 1e-9  # the gap is training time lost
    written = json.loads((job.run_dir / "summary.json").read_text())
    assert written["recoveries"] == result.recoveries


def test_a_controller_lost_before_any_checkpoint_keeps_the_lost_life_s_records(tmp_path):
    """No checkpoint: the restarted life trains from step 0 again, after the records of the lost one."""
    lost_at(tmp_path, 4)
    job = restarted(tmp_path)
    result = job.run()
    assert steps_recorded(job) == [1, 2, 3, *range(1, 11)]
    [loss] = result.recoveries
    assert (loss["kind"], loss["at_step"], loss["lost_steps"], loss["source"]) == ("controller", 1, 3, "initial")


def test_a_plain_resume_is_no_controller_loss(tmp_path):
    """``raymesh run --resume`` after a run ended or stopped: a new life, not a recovery."""
    lost_at(tmp_path, 8, **CHECKPOINTED)
    job = make_job(tmp_path, **CHECKPOINTED)
    job.resume = True
    assert job.run().recoveries == []
    assert [life["restarted"] for life in read_jsonl(job.run_dir / LIVES)] == [False, False]


def test_the_run_dir_tells_every_loss_ray_recovered_from(tmp_path):
    lost_at(tmp_path, 8, **CHECKPOINTED)
    job = restarted(tmp_path, **CHECKPOINTED)
    job.run()
    [loss] = controller_losses(job.run_dir)
    assert (loss.at_step, loss.lost_steps) == (6, 2) and loss.mttr_s >= GAP_S


class DeadController:
    """A hosted job whose actor Ray reports dead: every poll fails."""

    def __init__(self, spec: dict | None):
        self.job_id, self.spec, self.polls = "job-1", spec, 0

    def poll(self, cursor, incarnation, wait_s):
        self.polls += 1
        raise RayActorError()

    def actor_state(self):
        return "DEAD", "lost after 3 restart(s) of at most 3: the actor's process died"


def test_a_follower_stops_at_once_when_ray_gives_up_and_writes_the_summary_from_the_records(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(follow, "LOST_CONTROLLER_WAIT_S", 0.0)  # the old follower waited for this, then raised
    lost = lost_at(tmp_path, 8, **CHECKPOINTED)
    job = DeadController(lost.spec.to_dict())
    outcome = follow.follow(job, progress=False)
    assert job.polls == 1 and outcome["user_error"] is False and "raymesh run JOB --resume" in outcome["error"]
    summary = json.loads((lost.run_dir / "summary.json").read_text())
    assert outcome["summary"] == summary and summary["status"] == "failed"
    assert summary["error"] == "lost after 3 restart(s) of at most 3: the actor's process died"
    assert summary["steps"] == 7 and summary["losses"] == [1 / n for n in range(1, 8)]
    assert summary["checkpoints"] == [str(lost.ckpt.path_for(5))]
    assert follow.report(outcome, "job-1", str(tmp_path / "copy.json"), None) == 1
    assert json.loads((tmp_path / "copy.json").read_text()) == summary
    assert "gone for good (lost after 3 restart(s)" in capsys.readouterr().err


def test_an_ended_run_s_summary_is_kept_when_its_actor_was_let_go(tmp_path):
    """Another follower collected the outcome and released the actor: its summary stands."""
    job = make_job(tmp_path)
    job.run()
    before = (job.run_dir / "summary.json").read_text()
    assert lost_run_summary(job.run_dir, [], 2, "killed", str(job.run_dir)) is None
    outcome = follow._lost_for_good(SimpleNamespace(job_id="j", spec=job.spec.to_dict()), "killed")
    assert outcome == {"summary": json.loads(before)} and (job.run_dir / "summary.json").read_text() == before
