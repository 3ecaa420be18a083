"""The job's life as an explicit state machine: which states exist and which moves between them are legal.

A string assigned anywhere hid bugs (a recovery that forgot to go back to
running, a stop that overwrote ``failed``); here every move goes through
``JobStateMachine.to`` and an illegal one raises. ``recovering`` and
``resizing`` are internal: users (``raymesh status``, the control API) keep
seeing the six states they always saw, so those two read as ``running`` (or
``stopping`` once a stop was requested).
"""

from __future__ import annotations

import threading
from enum import Enum


class JobState(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    RESIZING = "resizing"
    STOPPING = "stopping"
    FINISHED = "finished"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (JobState.FINISHED, JobState.STOPPED, JobState.FAILED)


S = JobState
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.STARTING: frozenset({S.RUNNING, S.STOPPING, S.FAILED}),
    S.RUNNING: frozenset({S.RECOVERING, S.RESIZING, S.STOPPING, S.FINISHED, S.FAILED}),
    S.RECOVERING: frozenset({S.RUNNING, S.STOPPING, S.FAILED}),
    S.RESIZING: frozenset({S.RUNNING, S.RECOVERING, S.STOPPING, S.FAILED}),  # recovering: a rank lost while saving
    # a stop finishes the step in flight, which may fail (recover) or be the last (finished)
    S.STOPPING: frozenset({S.RECOVERING, S.RESIZING, S.STOPPED, S.FINISHED, S.FAILED}),
    S.FINISHED: frozenset(),
    S.STOPPED: frozenset(),
    S.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


class JobStateMachine:
    """The current state, every state visited (tests assert on it), and the stop flag the loop polls.

    Thread-safe: the control API's thread requests a stop while the driver thread moves the job on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.state = JobState.STARTING
        self.visited: list[JobState] = [JobState.STARTING]
        self.stop_requested = threading.Event()

    def to(self, new: JobState) -> None:
        with self._lock:
            self._move(new)

    def _move(self, new: JobState) -> None:
        if new is self.state:
            return
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"job state {self.state.value} -> {new.value} is not a legal transition; "
                                    f"fix: from {self.state.value} the job may go to "
                                    f"{sorted(s.value for s in TRANSITIONS[self.state]) or 'nowhere (it ended)'}")
        self.state = new
        self.visited.append(new)

    def fail(self) -> None:
        """Any live state may fail; an ended job stays as it ended."""
        with self._lock:
            if not self.state.terminal:
                self._move(JobState.FAILED)

    def request_stop(self) -> None:
        with self._lock:
            self.stop_requested.set()
            if self.state is JobState.RUNNING:
                self._move(JobState.STOPPING)

    def resume(self) -> None:
        """Back to training after start-up, a recovery or a resize: ``stopping`` when a stop came meanwhile."""
        self.to(JobState.STOPPING if self.stop_requested.is_set() else JobState.RUNNING)

    @property
    def public(self) -> str:
        """The state users see (``recovering``/``resizing`` are a running job's business)."""
        state = self.state
        if state in (JobState.RECOVERING, JobState.RESIZING):
            return "stopping" if self.stop_requested.is_set() else "running"
        return state.value
