"""The records that pass between the controller and the ranks' own loop (torch-free).

``Window``: what the controller hands every rank when it (re)starts their loop: train up to ``until``, with
the window's planned faults, skipped batches, snapshot and checkpoint cadence. ``Request``: what it asks rank 0
while the window runs (stop, a fault injected live). ``Boundary``: what rank 0 decides after each step and the
exchange tree carries to every rank, so all act on it at the same step. ``StepRecord``, ``SaveRecord``,
``Progress``, ``WindowEnd`` and ``LoopFailed`` are what rank 0 hands the controller, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CheckpointPlan:
    """When the ranks save a checkpoint inside a window, and where (the controller seals what they wrote)."""

    every: int = 0  # checkpoint.every; 0: no checkpoints
    async_save: bool = False
    last_step: int = 0  # train.steps: the run's last step always saves
    path_pattern: str = ""  # the step folder with a ``{step}`` field (``CheckpointDir.path_pattern``)
    dir_mode: int | None = None  # a local step folder's mode (checkpoint.permissions), set before it is written

    def due(self, step: int, stopping: bool) -> bool:
        """Every ``every`` steps, at the run's last step and at a step the run stops at (checkpoints on only)."""
        return bool(self.every) and (step % self.every == 0 or step == self.last_step or stopping)

    def path(self, step: int) -> str:
        return self.path_pattern.format(step=step)


@dataclass(frozen=True)
class Window:
    """Steps the ranks run on their own: from their current step to ``until`` (inclusive), unless a boundary
    stops them earlier.

    ``faults``: step -> rank -> the one-shot ``faults:`` entries due in the window (known in advance, so no call
    reaches a rank per step); ``slow``: rank -> a ``slow_rank`` entry, in force from its ``at_step`` on;
    ``skips``: step -> batches every rank passes over before training it (a batch that made that step NaN again
    and again).
    """

    until: int
    faults: dict[int, dict[int, dict]] = field(default_factory=dict)
    slow: dict[int, dict] = field(default_factory=dict)
    skips: dict[int, int] = field(default_factory=dict)
    snapshot_every: int = 0
    checkpoint: CheckpointPlan = field(default_factory=CheckpointPlan)
    detail_every: int = 1  # steps between per-rank detail (phases, memory) in the records; 1: every step

    def faults_at(self, step: int, slow: dict[int, dict]) -> dict[int, dict]:
        """rank -> the fault it injects at ``step``: a slow rank from its ``at_step`` on, a one-shot fault at its
        step (which wins on the same rank). ``slow``: the window's, plus those injected live since it started."""
        out = {rank: fault for rank, fault in slow.items() if step >= fault["at_step"]}
        out.update(self.faults.get(step, {}))
        return out

    def snapshot_due(self, step: int) -> bool:
        return bool(self.snapshot_every) and step % self.snapshot_every == 0

    def detail_due(self, step: int) -> bool:
        """Whether ``step``'s records carry every rank's own phases and memory (always on a window's last step)."""
        return self.detail_every <= 1 or step % self.detail_every == 0 or step == self.until


@dataclass(frozen=True)
class Request:
    """What the controller asks of the running window through rank 0's desk, applied at the next boundary:
    ``stop`` ends the window after that step (``stop``, ``resize``, ``pause``: why, for the record; a ``stop``
    saves the step first when checkpoints are on; rank 0 itself stops a window with ``preempt``); ``faults`` are
    injected into the next step; ``preempted``: ranks whose node is being drained (the controller heard it from
    Ray), which the window then treats as if their own processes had a preemption notice."""

    stop: str | None = None
    faults: tuple[dict, ...] = ()
    preempted: tuple[int, ...] = ()


@dataclass(frozen=True)
class Boundary:
    """What every rank agrees after ``step``: whether the window fails (``failed``: ``nan_loss``), stops
    (``stop``; ``preempt``: ``preempted`` ranks had a preemption notice, so the step is saved first), the faults
    of the next step, the snapshot replication floor (``keep_from``) and an asynchronous save every rank has
    finished (``collect``)."""

    step: int
    failed: str | None = None
    stop: str | None = None
    faults: dict[int, dict] = field(default_factory=dict)
    keep_from: int = -1
    collect: int | None = None
    preempted: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepRecord:
    """One completed step as rank 0 hands it to the controller: the merged ``StepSummary`` of every rank and
    when it was merged (the controller's step time is between two of these)."""

    step: int
    summary: Any  # workers.loop.summary.StepSummary
    time: float
    snapshot: bool = False  # the window snapshots this step (after this record)


@dataclass(frozen=True)
class SaveRecord:
    """A checkpoint every rank has written (``error`` None) or that failed on some rank (``error`` names the rank
    and the cause); the controller seals the first and reports the second."""

    step: int
    async_save: bool
    error: str | None = None
    seconds: float = 0.0  # how long the ranks' loop was held by it (0 for the finishing of an async save)
    done: bool = True  # False: an asynchronous save started, written later (a ``done`` record follows)
    time: float = 0.0  # rank 0's clock when the ranks' loop went on after it (0: it did not hold the loop)


@dataclass(frozen=True)
class Progress:
    """Rank 0 starts a phase that may take longer than a step (``save``, ``wait``); the controller's progress
    deadline allows for it."""

    phase: str
    step: int
    time: float


@dataclass(frozen=True)
class LoopFailed:
    """Rank 0's loop raised in the step after ``step`` (its own failure, or an exchange a failed peer broke): the
    controller asks every rank how its loop ended. A dead rank 0 hands over nothing; its loop's call says so."""

    step: int
    error: str


@dataclass(frozen=True)
class WindowEnd:
    """The window is over on every rank: at ``step`` (the last completed), because ``reason`` (``until``: it
    reached the window's end; ``stop``/``resize``/``pause``: asked; ``preempt``: ``ranks`` had a preemption
    notice, and the step is saved; ``nan_loss``: the next step's loss was not finite, nothing of it kept)."""

    step: int
    reason: str
    ranks: tuple[int, ...] = ()
