"""Sharded save and load of one rank's training state with DCP.

Model and optimizer state are keyed by global parameter names (layers keep
their global index on every pipeline stage), and DCP reshards on load, so a
checkpoint written at one layout loads at another. The data position and step
travel with it, so a resumed run continues with exactly the unseen samples.

A save that fails raises ``SaveFailed`` naming the folder and the cause: DCP gathers every rank's error into a
``CheckpointException`` whose text starts with a list of ranks and a traceback, and a full disk can surface there
as a serializer's "unexpected pos" rather than the ``OSError`` underneath, so the free space is said when no
``OSError`` is found.
"""

from __future__ import annotations

import logging
import shutil
from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

from workers.state.compression_feedback import saved_decays
from workers.state.known_weights import load_known
from workers.state.train_state import TrainState

log = logging.getLogger(__name__)


class SaveFailed(OSError):
    """A checkpoint save that failed on a rank: its text names the folder, the rank and the cause."""


class CheckpointIO:
    """DCP save/load of a ``TrainState``; an async save runs on its own process group."""

    def __init__(self, state: TrainState):
        self.state = state
        self.pending: Future | None = None
        self.pending_step: int | None = None
        self.pending_path: str | Path = ""
        # async saves run their collectives on their own group so they never interleave with training's
        self.group = dist.new_group(backend="gloo")

    def save(self, path: str | Path, async_save: bool) -> None:
        self.wait()
        with self.state.resident(write_back=False), _said(path):  # async_save stages its copy before returning
            state = self.state.state_dict()
            if self.state.wire_feedback is not None:  # compression's error feedback: what each rank held back
                state["wire_feedback"] = self.state.wire_feedback.dcp_state()
            if async_save:
                self.pending = dcp.async_save(state, checkpoint_id=str(path), process_group=self.group)
                self.pending_step, self.pending_path = self.state.step, path
            else:
                dcp.save(state, checkpoint_id=str(path), process_group=self.group)

    def wait(self) -> int | None:
        """Block until an in-flight async save is durable; return its step. A save that failed raises its error
        here once and is forgotten, so the next save is not refused for it."""
        if self.pending is None:
            return None
        pending, step = self.pending, self.pending_step
        self.pending = self.pending_step = None
        with _said(self.pending_path):
            pending.result()
        return step

    def durable(self) -> bool:
        """Whether no async save is still writing (the controller then seals it at once, not only when the
        next save is due)."""
        return self.pending is None or self.pending.done()

    def load(self, path: str | Path) -> None:
        """Read in place into this rank's current state (DCP reshards to its layout), then adopt it. A checkpoint
        holding model weights no rank's model has (more layers than the job's) is refused (``known_weights``)."""
        with self.state.resident():
            state = self.state.state_dict()
            load_known(state, path, self._model_names(state["model"]), process_group=self.group)
            self.state.load_state_dict(state)
        if self.state.wire_feedback is not None:
            self._load_wire_feedback(path, saved_decays(state["optim"]))

    def _model_names(self, model: dict) -> set[str]:
        """Every rank's model keys: a stage or shard reads only its own, and a checkpoint key none of them reads is
        one the job's model lacks. Gathered once per load (a resume or a rollback from disk)."""
        names: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(names, sorted(model), group=self.group)
        return set().union(*names)

    def _load_wire_feedback(self, path: str | Path, saved_decay: dict[str, float]) -> None:
        """Compression's error feedback (parameter-server top-k's, or ZeRO-0 PowerSGD's and top-k's, or 1-bit
        Adam's), where the checkpoint has this rank's (same layout, a run with that compression); otherwise it
        starts at zero. A partial load, apart from the strict one above, so a checkpoint without it (another
        layout, no compression, an older run) still loads. ``saved_decay``: the checkpoint's param groups, by
        which 1-bit Adam reads an older save's position-keyed errors."""
        feedback = {"wire_feedback": self.state.wire_feedback.dcp_state(template=True)}
        dcp.load(feedback, checkpoint_id=str(path), process_group=self.group,
                 planner=DefaultLoadPlanner(allow_partial_load=True))
        if not self.state.wire_feedback.load_dcp_state(feedback["wire_feedback"], str(path), saved_decay):
            log.warning("checkpoint %s holds no compression error feedback for this rank (saved at another layout "
                        "or parallel.bucket_mb, or without compression): it starts at zero", path)


class _said:
    """Re-raise a failed save of ``path`` as ``SaveFailed`` (an ``Exception``: DCP's is a ``BaseException``)."""

    def __init__(self, path: str | Path):
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or not isinstance(exc, (Exception, CheckpointException)) or isinstance(exc, SaveFailed):
            return False
        failed = SaveFailed(f"saving the checkpoint {self.path} failed: {_cause(exc, self.path)}")
        failed.errno = getattr(_root_os_error(exc), "errno", None)  # the text alone, without an "[Errno N]" head
        raise failed from exc


def _cause(exc: BaseException, path: str | Path) -> str:
    """What went wrong, in one line: the first ``OSError`` underneath (with the rank DCP says it failed on), else
    the error itself and the free space where the checkpoint goes."""
    rank, inner = _first_failure(exc)
    where = f"rank {rank}: " if rank is not None else ""
    found = _root_os_error(inner)
    if found is not None:
        return where + str(found)
    text = (str(inner).strip().splitlines() or [""])[0][:200]
    return f"{where}{type(inner).__name__}: {text}{_free_space(path)}"


def _first_failure(exc: BaseException) -> tuple[int | None, BaseException]:
    """(rank, error) of the lowest rank DCP reports failed, or (None, ``exc``) for an error of its own."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank = min(exc.failures)
        return rank, exc.failures[rank][0]
    return None, exc


def _root_os_error(exc: BaseException | None) -> OSError | None:
    """The first ``OSError`` in ``exc``, its causes and contexts, and DCP's per-rank failures."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and not isinstance(exc, SaveFailed):
            return exc
        exc = _first_failure(exc)[1] if isinstance(exc, CheckpointException) else exc.__cause__ or exc.__context__
    return None


def _free_space(path: str | Path) -> str:
    """"; N bytes free on its file system" for a local ``path`` (a full disk can fail a save without an OSError
    reaching DCP's report); nothing for a URL or a folder that is not there."""
    try:
        free = shutil.disk_usage(Path(path).parent if not Path(path).exists() else path).free
    except (OSError, ValueError):
        return ""
    full = " (No space left on device)" if free == 0 else ""
    return f"; {free} bytes free on the file system of {path}{full}"
