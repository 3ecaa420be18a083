"""A controller job on the fake rank group, recording what its observers were told (the controller's tests)."""

from __future__ import annotations

from orchestrator import JobSpec, TrainingJob
from orchestrator.observability.observers import JobObserver
from tests.support.fake_group import FakeRuntime
from tests.support.jobs import tiny_spec


class Recorder(JobObserver):
    """Every notification, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def on_checkpoint(self, blocking_s, committed: bool) -> None:
        self.seen.append(("checkpoint", committed))

    def on_recovered(self, record, step: int, restarted: int, phases_s: dict) -> None:
        self.seen.append(("recovery", record.kind, restarted, record.lost_steps))

    def on_ps_shard_recovered(self, record: dict) -> None:
        self.seen.append(("ps_shard", record["shard"], record["at_step"]))

    def on_resized(self, record, layout: dict) -> None:
        self.seen.append(("layout", layout["dp"]))

    def on_mttr(self, seconds: float) -> None:
        self.seen.append(("mttr",))

    def on_finish(self) -> None:
        self.seen.append(("finish",))


def make_job(tmp_path, faults=(), runtime=None, **sections):
    sections.setdefault("parallel", {"dp": 2})
    sections.setdefault("checkpoint", {"every": 0, "memory_every": 1})
    spec = tiny_spec(tmp_path / "data", tmp_path, **sections)
    spec = JobSpec.from_dict({**spec.to_dict(), "faults": list(faults)})
    job = TrainingJob(spec, progress=False, runtime=runtime or FakeRuntime())
    job.recorder = Recorder()
    job.observers.add(job.recorder)
    return job


def kill(rank: int, at_step: int, kind: str = "kill_rank") -> dict:
    return {"kind": kind, "rank": rank, "at_step": at_step}
