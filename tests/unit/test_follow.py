"""What ``raymesh run``/``attach`` show of a hosted controller: the feed a follower polls and the final lines."""

from __future__ import annotations

import argparse
import json
import re
import threading

import pytest

from orchestrator.cli.follow import _hosted_spec, _Terminal, report, resume_command, shows_progress
from orchestrator.runtime.hosted import Feed
from orchestrator.spec import JobSpec


def summary(**fields) -> dict:
    return {"steps": 7, "final_loss": 2.5, "tokens_per_s": 1234.0, "status": "finished", "checkpoints": [],
            "losses": [3.0, 2.5], **fields}


def test_a_follower_gets_what_it_has_not_seen_and_a_late_one_what_is_still_kept():
    feed = Feed(keep=3)
    for i in range(5):
        feed.add({"line": str(i)})
    assert feed.since(3, 0.0) == ([{"line": "3"}, {"line": "4"}], 5)
    assert feed.since(0, 0.0) == ([{"line": "2"}, {"line": "3"}, {"line": "4"}], 5)  # 0 and 1 fell out
    assert feed.since(5, 0.0) == ([], 5)


def test_a_waiting_follower_wakes_on_the_next_item():
    feed = Feed()
    threading.Timer(0.05, feed.add, [{"step": 1, "loss": 1.0, "tokens_per_s": 5.0}]).start()
    assert feed.since(0, 10.0) == ([{"step": 1, "loss": 1.0, "tokens_per_s": 5.0}], 1)


def test_the_resume_command_repeats_the_overrides_and_address():
    args = argparse.Namespace(job="jobs/my job.yaml", set=["train.steps=20", "optim.betas=[0.9, 0.99]"],
                              address="10.0.0.1:6379")
    assert resume_command(args) == ("raymesh run 'jobs/my job.yaml' --set train.steps=20 "
                                    "--set 'optim.betas=[0.9, 0.99]' --address 10.0.0.1:6379 --resume")


def test_a_stopped_run_names_its_checkpoint_and_the_resume_command(capsys, tmp_path):
    out = tmp_path / "s.json"
    stopped = summary(status="stopped", checkpoints=["/runs/a/checkpoints/step-00000007"], run_dir="/runs/a")
    assert report({"summary": stopped}, "job-1", str(out), "raymesh run job.yaml --resume") == 0
    printed = capsys.readouterr().out
    assert printed == ("done: 7 steps, final loss 2.5000, 1,234 tokens/s\n"
                       "  summary: /runs/a/summary.json\n"
                       f"  summary copy: {out}\n"
                       "  report: raymesh report /runs/a\n"
                       "  newest checkpoint: /runs/a/checkpoints/step-00000007\n"
                       "stopped at step 7 (checkpoint /runs/a/checkpoints/step-00000007); resume with:\n"
                       "  raymesh run job.yaml --resume\n")
    assert json.loads(out.read_text()) == stopped


def test_a_run_dir_in_a_bucket_is_named_by_its_url(capsys):
    assert report({"summary": summary(run_dir="s3://bkt/runs/a")}, "j", None, None) == 0
    printed = capsys.readouterr().out
    assert "summary: s3://bkt/runs/a/summary.json\n" in printed
    assert "report: raymesh report s3://bkt/runs/a\n" in printed
    spec = JobSpec.from_dict({"data": {"path": "/d"}, "run_dir": "s3://bkt/runs/a"})
    assert _hosted_spec(spec)["run_dir"] == "s3://bkt/runs/a"  # the controller stages it on its own machine


def test_a_stop_without_checkpoints_says_there_is_nothing_to_resume_from(capsys):
    """A --resume with no checkpoint is refused: the command would not continue anything."""
    assert report({"summary": summary(status="stopped", steps=0, final_loss=None)}, "j", None, "raymesh run x") == 0
    assert capsys.readouterr().out == (
        "done: 0 steps, no step trained, 1,234 tokens/s\n"
        "stopped at step 0 with no checkpoint (checkpoint.every is 0): there is nothing to resume from; run the job "
        "again to start over\n")


def test_a_stop_of_a_resumed_run_without_checkpoints_resumes_from_where_it_resumed(capsys):
    stopped = summary(status="stopped", resumed_from="/r/checkpoints/step-00000005")
    assert report({"summary": stopped}, "j", None, "raymesh run x --resume") == 0
    assert capsys.readouterr().out.endswith(
        "stopped at step 7 (no checkpoint of its steps; a resume continues from /r/checkpoints/step-00000005); "
        "resume with:\n  raymesh run x --resume\n")


def test_a_run_whose_last_save_failed_exits_1_naming_the_steps_not_kept_and_the_newest_checkpoint(capsys):
    failure = {"step": 10, "reason": "saving the checkpoint /c/step-00000010 failed: rank 0: [Errno 28] No space left "
                                     "on device", "last_on_disk": 8, "last_checkpoint": "/c/step-00000008",
               "steps_not_kept": "9-10"}
    failed = summary(status="failed", steps=10, checkpoints=["/c/step-00000004", "/c/step-00000008"],
                     checkpoint_failure=failure)
    assert report({"summary": failed}, "j", None, "raymesh run x --resume") == 1
    printed = capsys.readouterr()
    assert "  newest checkpoint: /c/step-00000008 (steps 9-10 not kept)\n" in printed.out
    assert printed.err == (
        "raymesh: error: job j failed: the checkpoint of its last step, 10, could not be saved (saving the checkpoint "
        "/c/step-00000010 failed: rank 0: [Errno 28] No space left on device); steps 9-10 are not kept: the newest "
        "checkpoint on disk is step 8 (/c/step-00000008)\n"
        "free space (or fix the cause) and continue from the newest checkpoint with:\n  raymesh run x --resume\n")


@pytest.mark.parametrize(("outcome", "code", "stream", "text"), [
    ({"complete": "the run in /r is complete"}, 0, "out", "raymesh: the run in /r is complete\n"),
    ({"error": "`parallel.dp` ...", "user_error": True}, 2, "err", "raymesh: error: job j: `parallel.dp` ...\n"),
    ({"error": "RuntimeError: gave up", "user_error": False}, 1, "err",
     "raymesh: error: job j: RuntimeError: gave up\n"),
    (None, 130, "err", "raymesh: detached from job j; it goes on training. Follow it with `raymesh attach j`, "
                       "end it with `raymesh stop j`\n"),
])
def test_every_other_ending_is_one_line_and_its_exit_status(capsys, outcome, code, stream, text):
    assert report(outcome, "j", None, None) == code
    assert getattr(capsys.readouterr(), stream) == text


def _terminal_lines(capsys, keep_summary: bool) -> list[str]:
    """What a follower's terminal shows for two steps with an event line and the summary line between them,
    cut at the carriage returns and newlines the progress bar and the lines write."""
    terminal = _Terminal(progress=True, keep_summary=keep_summary)
    terminal.show({"step": 1, "loss": 2.0, "tokens_per_s": 100.0}, 10)
    terminal.show({"line": "12:00:00 raymesh event=checkpoint step=1 path=/r/step-1"}, 10)
    terminal.show({"line": '12:00:01 raymesh event=summary json={"steps":1}'}, 10)
    terminal.show({"step": 2, "loss": 1.5, "tokens_per_s": 100.0}, 10)
    terminal.close()
    return re.split(r"[\r\n]", capsys.readouterr().err)


def test_event_lines_go_above_the_progress_bar_not_into_its_line(capsys):
    lines = _terminal_lines(capsys, keep_summary=False)
    assert "12:00:00 raymesh event=checkpoint step=1 path=/r/step-1" in lines  # a whole line of its own
    assert not any("event=" in line and "/10" in line for line in lines)  # never in the bar's "1/10 ..." line
    assert any("2/10" in line for line in lines)  # the bar went on below it
    assert not any("event=summary" in line for line in lines)  # kilobytes of JSON: the run dir has it


def test_a_submitted_job_keeps_the_summary_line_its_status_command_reads(capsys):
    assert '12:00:01 raymesh event=summary json={"steps":1}' in _terminal_lines(capsys, keep_summary=True)


@pytest.mark.parametrize("progress", [True, False])
def test_step_lines_show_only_where_no_progress_bar_shows_the_steps(capsys, progress):
    terminal = _Terminal(progress=progress)
    terminal.show({"line": "12:00:00 raymesh event=step step=1 loss=2.0000"}, 10)
    terminal.show({"line": "12:00:00 raymesh event=checkpoint step=1 path=/r/step-1"}, 10)
    terminal.close()
    err = capsys.readouterr().err
    assert ("event=step step=1" in err) is not progress and "event=checkpoint" in err


@pytest.mark.parametrize("tty, no_progress, bar", [(True, False, True), (True, True, False), (False, False, False)])
def test_the_bar_draws_only_on_a_terminal_a_log_gets_step_lines(monkeypatch, tty, no_progress, bar):
    """A ``ray job submit`` stream or a redirected run is no terminal: each redraw would be a line of its own."""
    monkeypatch.setattr("sys.stderr.isatty", lambda: tty)
    assert shows_progress(argparse.Namespace(no_progress=no_progress)) is bar
