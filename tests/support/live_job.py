"""A real job held at a step while a test talks to it (control API calls, wire probes), then let go."""

from __future__ import annotations

import threading

from orchestrator import TrainingJob
from orchestrator.api.auth import job_token
from orchestrator.api.control_server import ControlClient
from orchestrator.observability.observers import JobObserver
from tests.support.jobs import wait_for


class StepGate(JobObserver):
    """Holds the job in the bookkeeping of step ``step`` until the test has made its control-API calls.

    Without it, a tiny job on an idle machine can run its last step before the test's calls land, and the
    request meant for a live job arrives at a finished one.
    """

    def __init__(self, step: int):
        self.step = step
        self.reached, self.release = threading.Event(), threading.Event()

    def on_step(self, report) -> None:
        if report.record["step"] == self.step:
            self.reached.set()
            self.release.wait(300)


def start_live(spec, hold_at: int = 3):
    """Run ``spec`` in a thread held after step ``hold_at``; return a control client (with the job's token) and a
    function that lets the job go on and gives its result."""
    job = TrainingJob(spec, progress=False)
    gate = StepGate(hold_at)
    job.observers.add(gate)
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(result=job.run()))
    thread.start()
    wait_for(lambda: job.control is not None and gate.reached.is_set(), 120, f"the job to reach step {hold_at}")

    def finish():
        gate.release.set()
        thread.join(300)
        return outcome["result"]

    return ControlClient(job.control.address, job_token(job.run_dir).value), finish
