"""``orchestrator.Client`` and ``raymesh submit|status|logs|stop`` against the session's real Ray cluster.

A stand-in controller job (a real ``ControlServer`` in a real Ray job) checks the
client's side on its own; a ``gpt_tiny_3d`` job checks it with the real controller. Stopping a real run is
checked in tests/integration/test_job_submit.py, whose job is stopped through its control API.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
from ray.job_submission import JobSubmissionClient

from orchestrator import Client, SpecError
from orchestrator.cli.jobs import add_client_commands, format_status
from orchestrator.client import control_address, summary_from_log
from tests.support.jobs import wait_for

REPO = Path(__file__).parents[2]
JOB = REPO / "examples" / "gpt_tiny_3d.yaml"

FAKE_CONTROLLER = """
import json, threading, time
from orchestrator.api.auth import job_token
from orchestrator.api.control_server import ControlServer
from orchestrator.events import event

class Fake:
    def __init__(self):
        self.step, self.stopping, self.started = 0, threading.Event(), time.time()

    def status(self):
        return {"job": "fake", "state": "stopping" if self.stopping.is_set() else "running", "step": self.step,
                "total_steps": 100000, "loss": 1.0 / (self.step + 1), "tokens_per_s": 100.0,
                "layout": {"dp": 1, "pp": 1, "tp": 1, "world_size": 1}, "health": {0: 0.1},
                "started_unix": self.started}

    def request_stop(self, reason):
        event("stop", reason=reason)
        self.stopping.set()
        return "stopping"

fake = Fake()
token = job_token("run")  # Ray's token on this cluster (its token authentication is on)
server = ControlServer(fake, token.value, token_source=token.source)
event("control", **server.announcement())
while not fake.stopping.is_set() and fake.step < 100000:
    time.sleep(0.05)
    fake.step += 1
server.close()
summary = {"status": "stopped", "steps": 100000, "losses": [1.0] * fake.step, "final_loss": 1.0,
           "tokens_per_s": 100.0}
event("summary", json=json.dumps(summary, separators=(",", ":")))
"""


# -- no cluster needed -------------------------------------------------------------------


def test_newest_control_and_summary_lines_win():
    log = ("12:00:00 raymesh event=control address=10.0.0.1:5000\n"
           "12:00:01 raymesh event=summary json={\"steps\":1}\n"
           "12:00:02 raymesh event=control address=10.0.0.2:6000\n"
           "12:00:03 raymesh event=summary json={\"steps\":2,\"losses\":[1.5,1.25]}\n")
    assert control_address(log) == "10.0.0.2:6000"
    assert summary_from_log(log) == {"steps": 2, "losses": [1.5, 1.25]}
    assert control_address("no events\n") is None and summary_from_log("") is None


def test_format_status_live_and_ended():
    live = {"submission_id": "raysubmit_1", "ray_status": "running", "state": "running", "job": "tiny", "step": 12,
            "total_steps": 200, "loss": 4.25, "tokens_per_s": 1234.0, "layout": {"dp": 2, "pp": 2, "tp": 2,
            "zero": 0, "pp_schedule": "1f1b", "world_size": 8}, "health": {0: 0.2, 5: 1.5}, "started_unix": 100.0,
            "control_address": "10.0.0.1:5000"}
    assert format_status(live, now=165.0).splitlines() == [
        "tiny raysubmit_1: running, step 12/200, loss 4.2500, 1,234 tokens/s, up 1m05s",
        "layout: dp=2 pp=2 tp=2 zero=0 1f1b, 8 ranks",
        "heartbeats: 2 ranks, oldest 1.5s ago (rank 5)",
        "control API: 10.0.0.1:5000",
    ]
    ended = {"submission_id": "raysubmit_1", "ray_status": "succeeded", "state": "stopped", "message": None,
             "summary": {"steps": 200, "losses": [3.0, 2.5], "final_loss": 2.5, "tokens_per_s": 99.0}}
    assert format_status(ended) == "raysubmit_1: stopped (ray: succeeded); 200 steps, final loss 2.5000, 99 tokens/s"


# -- the session cluster -----------------------------------------------------------------


@pytest.fixture
def client(ray_cluster) -> Client:
    return Client(ray_cluster["dashboard"])


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="raymesh")
    add_client_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_bad_input_fails_before_submission(client, token_data, tmp_path):
    before = len(client.list_jobs())
    with pytest.raises(SpecError, match=r"`parallel.tp`: value 3"):
        client.submit(JOB, [f"data.path={token_data}", "parallel.tp=3"], working_dir=REPO)
    with pytest.raises(SpecError, match="outside the working directory"):
        client.submit(JOB, [f"data.path={token_data}"], working_dir=tmp_path)
    assert len(client.list_jobs()) == before


def test_unknown_job_is_named(client, ray_cluster, capsys):
    with pytest.raises(LookupError, match="no job 'raysubmit_nope'"):
        client.status("raysubmit_nope")
    assert cli("status", "raysubmit_nope", "--address", ray_cluster["dashboard"]) == 2
    assert "raymesh: error: no job 'raysubmit_nope'" in capsys.readouterr().err
    for request in (["inject", "raysubmit_nope", "--kind", "kill_rank"], ["scale", "raysubmit_nope", "--dp", "2"]):
        assert cli(*request, "--address", ray_cluster["dashboard"]) == 2  # was a RuntimeError traceback
        err = capsys.readouterr().err
        assert "raymesh: error: no job 'raysubmit_nope'" in err and ray_cluster["dashboard"] in err, err


def test_stand_in_controller_status_stop_and_summary(client, ray_cluster, tmp_path, capsys):
    (tmp_path / "fake_controller.py").write_text(textwrap.dedent(FAKE_CONTROLLER))
    job_id = JobSubmissionClient(ray_cluster["dashboard"]).submit_job(
        entrypoint=f"{shlex.quote(sys.executable)} fake_controller.py", runtime_env={"working_dir": str(tmp_path)})

    live = wait_for(lambda: (s := client.status(job_id))["state"] == "running" and s["step"] > 0 and s,
                    120, "the stand-in controller to report a step")
    assert live["job"] == "fake" and live["ray_status"] == "running" and live["health"] == {0: 0.1}
    assert "token=ray" in client.logs(job_id)  # the job runs in Ray's token mode and uses Ray's token
    assert live["control_address"] == control_address(client.logs(job_id))
    assert cli("status", job_id, "--address", ray_cluster["dashboard"]) == 0
    assert f"fake {job_id}: running, step" in capsys.readouterr().out

    assert cli("stop", job_id, "--address", ray_cluster["dashboard"], "--reason", "test over") == 0
    assert "stopping (the controller finishes" in capsys.readouterr().out
    assert client.wait(job_id, 60) == "succeeded"
    assert 'event=stop reason="test over"' in client.logs(job_id)  # quoted: a value cannot add fields

    ended = client.status(job_id)
    assert ended["state"] == "stopped" and ended["ray_status"] == "succeeded"
    assert ended["summary"] == client.summary(job_id) and 0 < len(ended["summary"]["losses"]) < 100000
    assert client.stop(job_id) == {"accepted": False, "state": "succeeded", "via": "none"}
    assert any(j["submission_id"] == job_id and j["status"] == "succeeded" for j in client.list_jobs())
    assert cli("logs", job_id, "--address", ray_cluster["dashboard"], "--follow") == 0
    assert "event=summary json=" in capsys.readouterr().out


def test_submit_status_logs_and_summary_of_a_real_run(client, token_data, tmp_path):
    steps = 16  # seconds of "running" on 2 busy cores; a fast machine may run them in less than a second
    job_id = client.submit(JOB, [f"data.path={token_data}", f"run_dir={tmp_path / 'run'}", f"train.steps={steps}",
                                 "checkpoint.every=0", "parallel.pp=1", "parallel.tp=1"],  # 2 ranks: the 8-rank grid
                           working_dir=REPO)  # is test_job_submit's README recipe
    # polled nearly back to back (a status call is itself a few round trips): polls 0.5 s apart, the default, can
    # straddle a run whose steps take tens of milliseconds and never see it running
    live = wait_for(lambda: (s := client.status(job_id))["state"] == "running" and s["step"] > 0 and s,
                    300, "the controller to report a step", poll_s=0.05)
    assert live["job"] == "gpt-tiny-3d" and live["total_steps"] == steps and live["loss"] > 0
    assert live["layout"]["world_size"] == 2 and len(live["health"]) == 2

    assert client.wait(job_id, 600) == "succeeded", client.logs(job_id)[-3000:]
    assert "event=start" in client.logs(job_id)
    summary = client.summary(job_id)
    assert len(summary["losses"]) == steps and summary["final_loss"] == summary["losses"][-1]
    assert client.status(job_id)["summary"] == summary

