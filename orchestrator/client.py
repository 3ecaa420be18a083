"""``Client``: submit, watch and stop raymesh jobs on a remote Ray cluster.

Ray's job submission SDK carries the job (upload, start, logs, kill); the
running controller's own gRPC control API (``orchestrator.api.control_server``) carries
what Ray cannot know: the step, loss and rank health, and a graceful stop that
finishes the current step and writes the summary. The controller announces
that API's address, and finally its summary, as lines in the job log, so the
log is the only channel the client needs besides the dashboard.

A job started with ``raymesh run`` rather than submitted is no Ray job the
dashboard knows: its controller is a named detached actor
(``orchestrator.runtime.hosted``), which the client finds through Ray by the
job id ``raymesh run`` printed (``ray_address``: default ``RAY_ADDRESS``, else
the local cluster).
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ray.exceptions import RpcError
from ray.job_submission import JobStatus, JobSubmissionClient

from orchestrator.api.auth import use_ray_token_if_present
from orchestrator.api.control_server import ControlClient, ControlUnreachable
from orchestrator.errors import SpecError
from orchestrator.events import parse_event
from orchestrator.runtime.cluster import check_reachable
from orchestrator.runtime.hosted import HostedJob
from orchestrator.spec import load_spec

SUMMARY_MARK = "event=summary json="
_SDK_ADDRESS_ENV = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")  # what Ray's job SDK lets override its address


def newest_event(log: str, name: str) -> dict[str, str] | None:
    """The fields of the newest whole ``event=NAME`` line (``events.parse_event``: a value quoted inside
    another event's line, such as a forged stop reason, never counts)."""
    for line in reversed(log.splitlines()):
        parsed = parse_event(line)
        if parsed is not None and parsed[0] == name:
            return parsed[1]
    return None


def control_address(log: str) -> str | None:
    """HOST:PORT from the newest ``event=control address=...`` log line, if any."""
    fields = newest_event(log, "control")
    return fields.get("address") if fields else None


def control_client(log: str) -> ControlClient | None:
    """A client for the control API the newest ``event=control`` line announces (with the job's token and,
    when announced, TLS); None before the announcement."""
    fields = newest_event(log, "control")
    return ControlClient.from_announcement(fields) if fields and "address" in fields else None


def summary_from_log(log: str) -> dict[str, Any] | None:
    """The summary JSON from the newest ``event=summary json=...`` log line, if any."""
    fields = newest_event(log, "summary")
    return json.loads(fields["json"]) if fields and "json" in fields else None


def _job_path(job_file: str | Path, working_dir: str | Path) -> str:
    """The job file's path relative to ``working_dir``: only that folder is uploaded."""
    job, root = Path(job_file).resolve(), Path(working_dir).resolve()
    if not job.is_relative_to(root):
        raise SpecError(None, str(job_file), f"is outside the working directory {root}, which is all that is "
                        "uploaded to the cluster", "move the job file under the working directory or pass "
                        "--working-dir a folder that contains it")
    return job.relative_to(root).as_posix()


def _job_client(address: str) -> JobSubmissionClient:
    """Ray's job client for ``address`` as given. Ray's SDK replaces its address by ``RAY_API_SERVER_ADDRESS`` or
    ``RAY_ADDRESS`` when either is set, which silently sent an explicit dashboard URL's requests to another cluster
    (or, with a stale ``RAY_ADDRESS``, to a GCS that made the client wait ~35 s and fail with a traceback)."""
    if "://" not in address:  # a GCS address HOST:PORT, which Ray resolves to its dashboard through the GCS
        check_reachable(address, "the dashboard address")
    hidden = {name: os.environ.pop(name) for name in _SDK_ADDRESS_ENV if name in os.environ}
    try:
        return JobSubmissionClient(address)
    finally:
        os.environ.update(hidden)


class Client:
    """One Ray cluster's raymesh jobs, addressed by the dashboard URL (e.g. ``http://127.0.0.1:8265``)."""

    def __init__(self, address: str, ray_address: str | None = None) -> None:
        self.address = address
        use_ray_token_if_present()  # a cluster with Ray's token authentication refuses a client without it
        self.ray_address = ray_address
        self._unreachable: ConnectionError | None = None
        try:
            self._dashboard = _job_client(address)
        except (ConnectionError, RpcError) as exc:  # raised when a call needs it: `raymesh run` jobs need no dashboard
            self._dashboard = None
            self._unreachable = ConnectionError(
                f"cannot reach the Ray dashboard at {address} ({exc}); check that the cluster is up (`ray status`), "
                "that its head was started with the dashboard (`ray start --head --include-dashboard=true`), "
                "and the address (--address or RAY_DASHBOARD_ADDRESS)"
            )

    @property
    def _jobs(self) -> JobSubmissionClient:
        if self._dashboard is None:
            raise self._unreachable
        return self._dashboard

    def _hosted(self, job_id: str) -> HostedJob | None:
        """The controller actor of a ``raymesh run`` job (one the dashboard does not know), else None."""
        found = None if self._known(job_id) else HostedJob.find(job_id, self.ray_address)
        if found is None and self._dashboard is None:
            raise LookupError(f"no running `raymesh run` controller for job {job_id!r} on the Ray cluster at "
                              f"{self._cluster()}, and {self._unreachable}")
        return found

    # -- the job, through Ray -------------------------------------------------------------

    def submit(self, job_file: str | Path, overrides: Sequence[str] = (), working_dir: str | Path = ".",
               entrypoint_args: Sequence[str] = ()) -> str:
        """Validate locally (so bad input fails here, not on the cluster), upload ``working_dir``, start the job.

        Returns the submission id. Relative paths in the job file resolve against
        the uploaded working directory on the cluster.
        """
        load_spec(job_file, overrides)
        entrypoint = ["raymesh", "run", _job_path(job_file, working_dir), "--no-progress"]
        for override in overrides:
            entrypoint += ["--set", override]
        entrypoint += list(entrypoint_args)
        return self._jobs.submit_job(entrypoint=shlex.join(entrypoint),
                                     runtime_env={"working_dir": str(working_dir)})

    def list_jobs(self) -> list[dict[str, Any]]:
        """Every job the cluster knows, oldest first; ``start_time`` in unix seconds."""
        return [
            {"submission_id": job.submission_id, "status": job.status.value.lower(), "entrypoint": job.entrypoint,
             "start_time": job.start_time / 1000 if job.start_time else None}
            for job in sorted(self._jobs.list_jobs(), key=lambda j: j.start_time or 0)
        ]

    def logs(self, submission_id: str) -> str:
        """The job's whole log so far."""
        self._info(submission_id)
        return self._jobs.get_job_logs(submission_id)

    def tail_logs(self, submission_id: str) -> Iterator[str]:
        """Log text as the job writes it (chunks, not always whole lines), ending when the job ends.

        Wraps the SDK's websocket tail, an async iterator, in a private event loop.
        """
        self._info(submission_id)
        chunks = self._jobs.tail_job_logs(submission_id)
        loop = asyncio.new_event_loop()
        try:
            while True:
                try:
                    yield loop.run_until_complete(anext(chunks))
                except StopAsyncIteration:
                    return
        finally:
            loop.run_until_complete(chunks.aclose())
            loop.close()

    def wait(self, submission_id: str, timeout_s: float) -> str:
        """Block until the job ends; return Ray's final status, lowercased (``succeeded``, ``failed``, ``stopped``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self._info(submission_id).status
            if status.is_terminal():
                return status.value.lower()
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {submission_id} on {self.address} is still {status.value.lower()} after "
                                   f"{timeout_s:g}s; check it with `raymesh status {submission_id}`")
            time.sleep(1.0)

    # -- the run, through the controller -------------------------------------------------

    def status(self, submission_id: str) -> dict[str, Any]:
        """Live status from the controller while it runs; Ray's status and the summary once it has ended.

        Always has ``submission_id``, ``state`` and ``ray_status``. A running job
        whose controller has not announced its control API yet is ``starting``.
        An ended job's ``state`` is the summary's ``status`` when there is one
        (a graceful stop exits 0, so Ray says ``succeeded`` where the run says
        ``stopped``), else Ray's status; ``summary`` is None without one.
        """
        hosted = self._hosted(submission_id)
        if hosted is not None:
            return hosted.status()
        info = self._info(submission_id)
        if info.status is JobStatus.PENDING:
            return {"submission_id": submission_id, "ray_status": "pending", "state": "pending",
                    "message": info.message}
        log = self._jobs.get_job_logs(submission_id)
        if info.status is JobStatus.RUNNING:
            control = control_client(log)
            if control is None:
                return {"submission_id": submission_id, "ray_status": "running", "state": "starting"}
            try:
                live = control.status()
                return {"submission_id": submission_id, "ray_status": "running", **live,
                        "control_address": control.address}
            except ControlUnreachable:  # fine if the run ended between the two looks, else the user must know
                info, log = self._info(submission_id), self._jobs.get_job_logs(submission_id)
                if not info.status.is_terminal() and summary_from_log(log) is None:
                    raise
        summary = summary_from_log(log)
        if summary is None and (hosted := HostedJob.find(submission_id, self.ray_address)) is not None:
            return hosted.status()  # its entrypoint ended (killed?) but the controller it started goes on
        ray_status = info.status.value.lower()
        state = summary.get("status", ray_status) if summary else ray_status
        return {"submission_id": submission_id, "ray_status": ray_status, "state": state, "message": info.message,
                "summary": summary}

    def stop(self, submission_id: str, reason: str = "") -> dict[str, Any]:
        """Ask the controller to stop after the current step; kill the job through Ray if it cannot be reached.

        Returns ``accepted``, ``state`` and ``via`` (``control``, ``ray``, or
        ``none`` when the job had already ended).
        """
        hosted = self._hosted(submission_id)
        if hosted is not None:
            return hosted.stop(reason)
        info = self._info(submission_id)
        if info.status.is_terminal():
            return {"accepted": False, "state": info.status.value.lower(), "via": "none"}
        control = control_client(self._jobs.get_job_logs(submission_id))
        if control is not None:
            try:
                return {**control.stop(reason), "via": "control"}
            except ControlUnreachable:
                pass  # not up yet, or already gone: Ray can still stop the job
        accepted = self._jobs.stop_job(submission_id)
        state = "stopping" if accepted else self._info(submission_id).status.value.lower()
        return {"accepted": accepted, "state": state, "via": "ray"}

    def inject_fault(self, submission_id: str, kind: str, rank: int, factor: float = 3.0) -> int:
        """Make ``rank`` of a running job fail at its next step (a drill); returns that step."""
        return self._control(submission_id).inject_fault(kind, rank, factor)

    def request_scale(self, submission_id: str, dp: int) -> int:
        """Resize a running job's data parallelism after its current step; returns that step."""
        return self._control(submission_id).request_scale(dp)

    def _control(self, submission_id: str) -> ControlClient:
        """The control API of a running job: its ``raymesh run`` controller's, else the one a submitted job's log
        announces. An unknown id or an ended job is a ``LookupError`` naming it (the dashboard's 404 was a
        ``RuntimeError`` traceback)."""
        hosted = self._hosted(submission_id)
        if hosted is not None:
            return hosted.control()
        info = self._info(submission_id)
        if info.status.is_terminal():
            raise LookupError(f"job {submission_id} on {self.address} has ended ({info.status.value.lower()}): it "
                              f"takes no more requests; see `raymesh status {submission_id}`")
        control = control_client(self._jobs.get_job_logs(submission_id))
        if control is None:
            raise LookupError(f"job {submission_id} has not announced its control API yet (no `event=control` "
                              f"line in its log); wait until `raymesh status {submission_id}` says running")
        return control

    def summary(self, submission_id: str) -> dict[str, Any]:
        """The summary JSON the controller logs when the run ends (steps, losses, layout, ...)."""
        summary = summary_from_log(self.logs(submission_id))
        if summary is None:
            raise LookupError(f"job {submission_id} on {self.address} has no `{SUMMARY_MARK}...` line in its log; "
                              f"the controller writes it when the run ends: check `raymesh status {submission_id}` "
                              f"and `raymesh logs {submission_id}`")
        return summary

    def _known(self, submission_id: str) -> bool:
        """Whether the dashboard knows ``submission_id`` as a Ray job (False when there is no dashboard)."""
        if self._dashboard is None:
            return False
        try:
            self._jobs.get_job_info(submission_id)
        except RuntimeError as exc:
            if "status code 404" in str(exc):
                return False
            raise
        return True

    def _info(self, submission_id: str):
        try:
            return self._jobs.get_job_info(submission_id)
        except RuntimeError as exc:
            if "status code 404" in str(exc):
                raise LookupError(f"no job {submission_id!r}: the Ray dashboard at {self.address} has no submitted "
                                  f"job of that id, and the Ray cluster at {self._cluster()} runs no `raymesh run` "
                                  f"controller for it; list the submitted jobs with `ray job list --address "
                                  f"{self.address}`, pass the id `raymesh run` printed, or name the cluster with "
                                  "--address / --ray-address") from None
            raise

    def _cluster(self) -> str:
        """Where a ``raymesh run`` controller was looked for, in words."""
        return self.ray_address or os.environ.get("RAY_ADDRESS") or "this machine (no RAY_ADDRESS)"
