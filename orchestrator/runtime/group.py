"""What the controller needs from a rank group and from the cluster, as protocols it is handed.

A group starts its ranks' loops on a window of steps (``start_window``), hands over rank 0's desk items as they
come (``window_items``: one call whatever the world size), takes the controller's requests to rank 0 (``post``),
and when a window failed says which ranks failed it (``window_failed`` raises ``StepFailed``), or, when no step
completed within the progress deadline, which ranks are stuck (``window_hung``).

``TrainingJob`` calls these and nothing else of Ray: ``RayRuntime`` (the
default, ``ray_runtime.py``) reserves placement groups and starts ``RankGroup`` actors; the unit
tests hand it a fake runtime whose group fails, hangs and returns NaN on cue,
so every controller transition runs in milliseconds without a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn, Protocol

from orchestrator.spec import JobSpec
from workers.loop.plan import Request, Window
from workers.protocol import RankInfo


@dataclass
class StepFailed(Exception):
    """A step that did not complete on every rank, and why: ``kind`` is ``rank`` (died), ``hang``, ``oom``,
    ``error`` (a live rank's step raised), ``preempt`` (told to go, its step saved) or ``nan_loss``."""

    dead: dict[int, str]  # rank -> "died" | "hung" | "ran out of memory (...)" | "raised (...)"
    kind: str = ""
    stacks: str | None = None  # a hang: the directory of every rank's stacks (``RankGroup._diagnose``)

    def __post_init__(self) -> None:
        self.kind = self.kind or _kind(self.dead.values())

    def __str__(self) -> str:
        return ", ".join(f"rank {r} {how}" for r, how in sorted(self.dead.items())) or self.kind


# a survivor still blocked in its failed step after the grace: restarted with the dead ranks, not counted as a
# failure of its own (``RankGroup.finish_failed_step``)
ABANDONED = "abandoned"
PREEMPTED = "preempted"  # a rank that had a preemption notice, its step saved (``RankGroup.preempted``)


def _kind(hows) -> str:
    hows = list(hows)
    for prefix, kind in (("hung", "hang"), ("ran out of memory", "oom"), ("raised", "error"), (PREEMPTED, "preempt")):
        if any(how.startswith(prefix) for how in hows):
            return kind
    return "rank"


class Placement(Protocol):
    def release(self) -> None: ...


class RankGroupLike(Protocol):
    """The calls ``TrainingJob`` makes on ``RankGroup`` (see it for what each does)."""

    worker_extra: dict

    def form(self) -> list[RankInfo]: ...
    def start_window(self, window: Window, window_id: int) -> None: ...
    def window_items(self, wait_s: float) -> list: ...
    def window_failed(self) -> NoReturn: ...
    def window_hung(self, silent_s: float) -> NoReturn: ...
    def preempted(self, ranks) -> NoReturn: ...
    def post(self, request: Request) -> int | None: ...
    def finish_failed_step(self) -> dict[int, str]: ...
    def replace(self, ranks) -> None: ...
    def start_spares(self) -> None: ...
    def placed(self, ranks, timeout_s: float) -> bool: ...
    def snapshot(self, keep_from: int = -1) -> None: ...
    def restore(self, replaced: set[int], up_to: int) -> int: ...
    def survivor_snapshots(self, dead: set[int], up_to: int) -> tuple[int, dict] | None: ...
    def restore_positions(self, step: int, kept: dict) -> int: ...
    def call(self, method: str, *args) -> list: ...
    def stop(self) -> None: ...


class Runtime(Protocol):
    """Where the job runs: cluster connection, start-up checks, placement, groups, node liveness, control API."""

    def preflight(self, spec: JobSpec) -> None: ...
    def connect(self, address: str | None, needed_cpus: float) -> None: ...
    def available(self) -> tuple[float, float]: ...
    def reserve(self, spec: JobSpec, use_gpu: bool, timeout_s: float) -> Placement: ...
    def start_group(self, spec: JobSpec, placement: Placement, use_gpu: bool) -> RankGroupLike: ...
    def check_job_faults(self, faults: list[dict], placement: Placement) -> None: ...
    def kill_node_refusal(self, rank: int, node_id: str) -> str | None: ...
    def nodes_gone(self, node_ids) -> set[str]: ...
    def elastic(self, spec: JobSpec): ...
    def serve_control(self, job): ...
