"""The controller as a detached Ray actor: a run that outlives the process that started it.

``raymesh run`` (and the entrypoint of a ``ray job submit``) used to *be* the
controller, so killing that process ended the run. Now it starts
``ControllerActor`` (``lifetime="detached"``, named ``controller:<job id>`` in
the ``raymesh`` namespace, as Ray Train V2 hosts its controller) and only
follows it; ``raymesh attach ID`` follows it again from anywhere that reaches
the cluster, ``raymesh stop ID`` ends it. The actor has ``max_restarts``: when
its process is lost, Ray starts it again and the constructor resumes the run
from the run dir's newest checkpoint (without one the run starts over at step 0).

What a driver shows is a ``Feed``: the controller's event lines and one small
record per step (for the progress bar), numbered so a follower asks for what
it has not seen. Ray owns the name, so nothing has to be announced in a log;
``HostedJob`` is the handle the CLI and ``Client`` use.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray

from orchestrator.api.control_server import ControlClient
from orchestrator.events import event
from orchestrator.observability.observers import JobObserver, StepReport

NAMESPACE = "raymesh"
MAX_RESTARTS = 3  # losses of the controller process the run survives (each resumes from the newest checkpoint)
LINGER_S = 600.0  # an ended run's actor waits this long for a follower to collect its outcome, then exits
FEED_ITEMS = 20_000  # a follower that falls further behind misses the oldest lines (the run dir has them all)
_EVENT_FORMAT = logging.Formatter("%(asctime)s raymesh %(message)s", "%H:%M:%S")


def actor_name(job_id: str) -> str:
    return f"controller:{job_id}"


def job_id_for(spec) -> str:
    """The job id ``raymesh run`` hosts ``spec`` under: the submission id inside a ``ray job submit``, else the
    job name and a hash of its run dir (one live controller per run dir; the same id after a restart)."""
    run_dir = str(spec.resolved_run_dir().resolve())
    return submission_id() or f"{spec.name}-{hashlib.sha1(run_dir.encode()).hexdigest()[:8]}"


def submission_id() -> str | None:
    """The ``ray job submit`` id when this process is a submitted job's entrypoint (Ray passes it in the job
    config it hands the entrypoint), else None."""
    config = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    return json.loads(config).get("metadata", {}).get("job_submission_id") if config else None


class Feed:
    """What the controller has shown so far, numbered from 0: ``{"line": ...}`` event lines and
    ``{"step": ..., "loss": ..., "tokens_per_s": ...}`` / ``{"rollback": step}`` records."""

    def __init__(self, keep: int = FEED_ITEMS):
        self._items: collections.deque = collections.deque(maxlen=keep)
        self._next = 0
        self._changed = threading.Condition()

    def add(self, item: dict) -> None:
        with self._changed:
            self._items.append(item)
            self._next += 1
            self._changed.notify_all()

    def since(self, cursor: int, wait_s: float) -> tuple[list[dict], int]:
        """Items from ``cursor`` on (waiting up to ``wait_s`` for one) and the cursor after them."""
        with self._changed:
            self._changed.wait_for(lambda: self._next > cursor, timeout=wait_s)
            first = self._next - len(self._items)
            return list(self._items)[max(cursor - first, 0):], self._next

    def wake(self) -> None:
        with self._changed:
            self._changed.notify_all()


class _FeedLines(logging.Handler):
    """Copies the ``raymesh`` logger's event lines into the feed (they still go to the actor's log too)."""

    def __init__(self, feed: Feed):
        super().__init__()
        self.feed = feed
        self.setFormatter(_EVENT_FORMAT)

    def emit(self, record: logging.LogRecord) -> None:
        self.feed.add({"line": self.format(record)})


class _FeedSteps(JobObserver):
    """The per-step facts a follower's progress bar needs."""

    def __init__(self, feed: Feed):
        self.feed = feed

    def on_step(self, report: StepReport) -> None:
        r = report.record
        held = {"eval_loss": r["eval_loss"]} if "eval_loss" in r else {}  # the follower's bar shows the newest
        self.feed.add({"step": r["step"], "loss": r["loss"], "tokens_per_s": r["tokens_per_s"], **held})

    def on_rollback(self, step: int) -> None:
        self.feed.add({"rollback": step})


class ControllerActor:
    """Hosts one ``TrainingJob``: runs it on a thread from the constructor, serves followers and the control API.

    Created by ``start``; ``was_current_actor_reconstructed`` tells a restart after the process was lost, which
    resumes from the newest checkpoint whatever the first start asked.
    """

    def __init__(self, spec_dict: dict, resume: bool, job_id: str):
        from orchestrator.runtime.controller import TrainingJob
        from orchestrator.spec import JobSpec

        self.job_id, self.spec_dict_started = job_id, spec_dict
        self.incarnation = uuid.uuid4().hex  # a restarted actor's feed starts again at 0
        self.feed = Feed()
        logging.getLogger("raymesh").addHandler(_FeedLines(self.feed))
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if restarted:
            event("controller_restarted", job_id=job_id, action="resuming from the newest checkpoint (step 0 if none)")
        self.job = TrainingJob(JobSpec.from_dict(spec_dict), resume=resume or restarted, progress=False,
                               restarted=restarted, job_id=job_id)
        self.job.observers.add(_FeedSteps(self.feed))
        self.outcome: dict | None = None
        threading.Thread(target=self._run, name="raymesh-controller", daemon=True).start()

    def _run(self) -> None:
        self.outcome = run_outcome(self.job, self.job_id)
        self.feed.wake()
        time.sleep(LINGER_S)  # nobody collected the outcome: the run dir keeps summary.json and the records
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def poll(self, cursor: int, incarnation: str, wait_s: float = 1.0) -> dict:
        """New feed items for a follower; ``outcome`` only once every item before it was handed out."""
        if incarnation != self.incarnation:
            cursor = 0
        outcome = self.outcome  # read first: items taken after it include everything the run produced
        items, cursor = self.feed.since(cursor, 0.0 if outcome else wait_s)
        return {"items": items, "cursor": cursor, "incarnation": self.incarnation, "outcome": outcome,
                "total_steps": self.job.spec.train.steps}

    def control_announcement(self) -> dict[str, str] | None:
        """Where and how to call the job's control API (``ControlServer.announcement``); None until it is open."""
        return self.job.control.announcement() if self.job.control is not None else None

    def request_stop(self, reason: str) -> str:
        return self.job.request_stop(reason)

    def spec_dict(self) -> dict:
        """The job as it was started: where a follower finds its run dir should this actor be lost for good."""
        return self.spec_dict_started

    def result(self) -> dict | None:
        return self.outcome


def run_outcome(job, job_id: str) -> dict:
    """Run ``job`` (a ``TrainingJob``) to its end; what a follower collects of it: ``summary`` or ``error``."""
    try:
        return {"summary": _summary(job)}
    except Exception as exc:  # the follower shows it; a user's mistake (ValueError, SpecError) exits 2
        event("failed", job_id=job_id, error=repr(exc))
        return {"error": f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc),
                "user_error": isinstance(exc, ValueError)}


def _summary(job) -> dict:
    """The run's summary. A resume that finds the run complete (the CLI refuses a ``--resume`` of one before it
    starts the actor, so here Ray restarted the controller after the final save) hands over the run's summary,
    written if the lost controller had not (``TrainingJob.finished_summary``)."""
    from orchestrator.runtime.controller import RunComplete

    try:
        return job.run().to_dict()
    except RunComplete as done:
        return job.finished_summary(done)


def lost_for_good(spec_dict: dict, job_id: str, reason: str) -> dict:
    """The outcome of a run whose controller Ray gave up restarting (``reason``), for its follower: the run's
    ``summary.json`` when it had ended, else one written now from the run dir's records (status ``failed``,
    ``error`` the reason) with an error saying how to go on."""
    from orchestrator.checkpoints.directory import CheckpointDir
    from orchestrator.observability.remote_run_dir import run_dir_upload
    from orchestrator.observability.run_records import RunRecords, lost_run_summary
    from orchestrator.spec import JobSpec

    spec = JobSpec.from_dict(spec_dict)
    upload = run_dir_upload(spec)
    if upload is not None:  # the bucket's copy of the run dir
        upload.pull()
    run_dir, ckpt = spec.resolved_run_dir(), CheckpointDir(spec.checkpoint_dir(), spec.checkpoint.keep)
    summary = lost_run_summary(run_dir, [str(ckpt.path_for(s)) for s in ckpt.complete_steps()], spec.parallel.dp,
                               reason, spec.run_dir_url() or str(run_dir))
    if summary is None:
        return {"summary": json.loads((run_dir / "summary.json").read_text())}
    RunRecords.write_summary(run_dir, summary)
    if upload is not None:
        upload.push()
    event("failed", job_id=job_id, error=reason, summary="written from the run dir's records")
    return {"error": f"the controller of job {job_id} is gone and Ray will not restart it ({reason}); its run "
                     f"dir holds the records (summary.json, status failed) and checkpoints: continue with "
                     "`raymesh run JOB --resume`", "user_error": False, "summary": summary}


def _runtime_env() -> dict | None:
    """What the actor (and the ranks it starts) need from this process's environment: our ``PYTHONPATH``
    (a checkout that is not installed), else nothing. A submitted job's working directory comes with the job's
    own runtime env, which the actor inherits. Nothing else, because an actor with a runtime env of its own
    starts in a fresh process through Ray's runtime-env setup (~1 s more on a loaded host) where one without
    can take a worker Ray has already started; Ray gives an actor of ``num_cpus=0`` one OpenMP thread anyway."""
    if os.environ.get("PYTHONPATH"):
        return {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}
    return None


def _death_cause(info: dict) -> str:
    """Why Ray reports a controller actor dead, in a line: the lives it had and the error Ray recorded."""
    from google.protobuf.json_format import MessageToDict

    cause = MessageToDict(info["DeathCause"]) if info.get("DeathCause") is not None else {}
    said = [v["errorMessage"] for v in cause.values() if isinstance(v, dict) and v.get("errorMessage")]
    lives = f"lost after {info.get('NumRestarts', 0)} restart(s) of at most {MAX_RESTARTS}"
    return f"{lives}: {said[0].splitlines()[0][:300]}" if said else lives


class AlreadyRunning(RuntimeError):
    """A live controller already hosts this job id."""


def join_cluster(ray_address: str | None) -> None:
    """Connect this driver to the cluster at ``ray_address`` (else ``RAY_ADDRESS``, else this user's ``ray start``
    head on this machine, else a ``raymesh run``'s own local Ray: ``cluster.join``); never starts one.
    ``ConnectionError`` naming the address, where it came from and the fix when there is none: ``raymesh attach``
    must say the cluster is unreachable, not that it holds no controller."""
    from orchestrator.runtime import cluster

    named = cluster.named_address(ray_address, "--ray-address")
    try:
        cluster.join(ray_address, "--ray-address")
    except (ConnectionError, RuntimeError) as exc:  # no cluster there (Ray raises either)
        where = f"at {named[0]} (from {named[1]})" if named else "running on this machine"
        raise ConnectionError(f"cannot reach a Ray cluster {where}: {exc}; fix: start it (`ray start --head`), or "
                              "pass --ray-address HOST:PORT (or set RAY_ADDRESS) naming the cluster the job runs "
                              "on") from None


@dataclass
class HostedJob:
    """A job's controller actor, found by job id: what ``raymesh attach/status/stop/inject/scale`` talk to."""

    job_id: str
    handle: Any
    spec: dict | None = None  # the job (``JobSpec.to_dict``) once known: where its run dir is

    @classmethod
    def start(cls, spec_dict: dict, resume: bool, job_id: str) -> HostedJob:
        """Create the detached controller (Ray must be initialized); ``AlreadyRunning`` if one runs already."""
        found = cls.find(job_id)
        if found is not None:
            if found.outcome() is None:
                raise AlreadyRunning(
                    f"job {job_id} is already running (its controller outlives the process that started it); "
                    f"follow it with `raymesh attach {job_id}` or end it with `raymesh stop {job_id}`")
            found.release()  # an ended run still waiting for a follower: this start replaces it
        handle = ray.remote(ControllerActor).options(
            name=actor_name(job_id), namespace=NAMESPACE, lifetime="detached", max_restarts=MAX_RESTARTS,
            max_task_retries=0, max_concurrency=16, num_cpus=0, runtime_env=_runtime_env(),
        ).remote(spec_dict, resume, job_id)
        return cls(job_id, handle, spec_dict)

    @classmethod
    def find(cls, job_id: str, ray_address: str | None = None) -> HostedJob | None:
        """The live controller of ``job_id``, or None (also when no Ray cluster can be reached)."""
        try:
            join_cluster(ray_address)
        except ConnectionError:
            return None
        try:
            return cls(job_id, ray.get_actor(actor_name(job_id), namespace=NAMESPACE))
        except ValueError:
            return None

    def poll(self, cursor: int, incarnation: str, wait_s: float) -> dict:
        return ray.get(self.handle.poll.remote(cursor, incarnation, wait_s), timeout=wait_s + 60)

    def actor_state(self) -> tuple[str | None, str]:
        """Ray's state of the controller actor (``ALIVE``, ``RESTARTING``, ``DEAD``, ...) and, once ``DEAD``, why;
        ``(None, "")`` when the cluster's GCS cannot tell. Asked of the GCS itself (Ray's state API needs a
        dashboard, which a local Ray of ``raymesh run``'s own has not)."""
        try:
            info = ray._private.state.actors(actor_id=self.handle._actor_id.hex())
        except Exception:  # the GCS is unreachable: nothing is known
            return None, ""
        if not info:
            return None, ""
        return info["State"], _death_cause(info) if info["State"] == "DEAD" else ""

    def remember_spec(self) -> None:
        """Ask the live controller for its job once (``spec``): a follower needs its run dir after a loss."""
        if self.spec is None:
            self.spec = ray.get(self.handle.spec_dict.remote(), timeout=60)

    def outcome(self) -> dict | None:
        return ray.get(self.handle.result.remote(), timeout=60)

    def control_announcement(self) -> dict[str, str] | None:
        return ray.get(self.handle.control_announcement.remote(), timeout=60)

    def control(self) -> ControlClient:
        """The control API client of the controller (its address, token and TLS); ``LookupError`` while it has
        not opened its API yet."""
        fields = self.control_announcement()
        if fields is None:
            raise LookupError(f"job {self.job_id} is still starting (its controller has not opened its control "
                              f"API yet); try again in a few seconds")
        return ControlClient.from_announcement(fields)

    def status(self) -> dict:
        """The same dict as ``Client.status`` (``ray_status`` is the actor's: running until its outcome is in)."""
        outcome = self.outcome()
        if outcome is not None:
            summary = outcome.get("summary")
            state = summary["status"] if summary else ("finished" if "complete" in outcome else "failed")
            return {"submission_id": self.job_id, "ray_status": state, "state": state, "summary": summary,
                    "message": outcome.get("error") or outcome.get("complete")}
        try:
            control = self.control()
        except LookupError:
            return {"submission_id": self.job_id, "ray_status": "running", "state": "starting"}
        return {"submission_id": self.job_id, "ray_status": "running", **control.status(),
                "control_address": control.address}

    def stop(self, reason: str = "") -> dict:
        """Graceful stop through the control API (through the actor while the API is not open yet)."""
        if self.outcome() is not None:
            return {"accepted": False, "state": self.status()["state"], "via": "none"}
        if self.control_announcement() is None:
            state = ray.get(self.handle.request_stop.remote(reason), timeout=60)
            return {"accepted": state not in ("finished", "failed"), "state": state, "via": "actor"}
        return {**self.control().stop(reason), "via": "control"}

    def release(self) -> None:
        """End the actor for good: the run has ended and its outcome was collected (or is being replaced)."""
        ray.kill(self.handle, no_restart=True)
