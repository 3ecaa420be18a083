"""`raymesh inject|scale|status|logs|stop ID` of an id the cluster does not know, or of a job that has ended: one
line naming the id and where it was looked for, exit 2, no traceback. Ray-free: the dashboard's job client is a
stand-in that answers as Ray's does (a 404 ``RuntimeError``), and no `raymesh run` controller is found."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ray.job_submission import JobStatus

from orchestrator import client as client_module
from orchestrator.cli.commands import main

DASHBOARD = "http://127.0.0.1:8265"


class _Dashboard:
    """Ray's ``JobSubmissionClient`` as it answers for the jobs in ``jobs`` (id -> status), 404 for any other."""

    def __init__(self, jobs: dict[str, JobStatus]):
        self.jobs = jobs

    def _known(self, job_id: str) -> None:
        if job_id not in self.jobs:
            raise RuntimeError(f"Request failed with status code 404: Job {job_id} does not exist.")

    def get_job_info(self, job_id: str):
        self._known(job_id)
        return SimpleNamespace(status=self.jobs[job_id], message="")

    def get_job_logs(self, job_id: str) -> str:
        self._known(job_id)
        return ""


@pytest.fixture
def dashboard(monkeypatch):
    jobs: dict[str, JobStatus] = {}
    monkeypatch.setattr(client_module, "_job_client", lambda address: _Dashboard(jobs))
    monkeypatch.setattr(client_module.HostedJob, "find", classmethod(lambda cls, job_id, address=None: None))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return jobs


@pytest.mark.parametrize("command", [["inject", "nope", "--kind", "kill_rank"], ["scale", "nope", "--dp", "2"],
                                     ["status", "nope"], ["logs", "nope"], ["stop", "nope"]])
def test_an_unknown_id_is_named_with_where_it_was_looked_for(dashboard, command, capsys):
    assert main([*command, "--address", DASHBOARD, "--ray-address", "10.0.0.9:6379"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raymesh: error: no job 'nope': ") and err.count("\n") == 1, err
    assert f"dashboard at {DASHBOARD}" in err and "Ray cluster at 10.0.0.9:6379" in err


@pytest.mark.parametrize("command", [["inject", "done", "--kind", "kill_rank"], ["scale", "done", "--dp", "2"]])
def test_a_request_to_an_ended_job_says_it_has_ended(dashboard, command, capsys):
    dashboard["done"] = JobStatus.SUCCEEDED
    assert main([*command, "--address", DASHBOARD]) == 2
    assert "job done on http://127.0.0.1:8265 has ended (succeeded)" in capsys.readouterr().err
