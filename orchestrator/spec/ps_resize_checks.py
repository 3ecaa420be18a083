"""Checks of `parameter_server.resize` (shards added or removed between steps), beside the other sections'."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


def check_ps_resize(job: JobSpec) -> None:
    """Each resize needs the shards, falls inside the run, comes after the one before it and changes the count."""
    ps = job.parameter_server
    if ps.resize and job.parallel.dp_sync != "ps":
        raise SpecError("parameter_server.resize", [r.model_dump() for r in ps.resize],
                        "needs parameter-server shards", "set parallel.dp_sync: ps, or remove parameter_server.resize")
    before, last_step = ps.shards, 1
    for i, r in enumerate(ps.resize):
        if not last_step < r.at_step <= job.train.steps:
            raise SpecError(f"parameter_server.resize[{i}].at_step", r.at_step,
                            f"must lie after the previous resize's step ({last_step}) and within train.steps "
                            f"({job.train.steps}): the chunks move between two steps of the run",
                            f"pick a step from {last_step + 1} to {job.train.steps}, in increasing order")
        if r.shards == before:
            raise SpecError(f"parameter_server.resize[{i}].shards", r.shards,
                            f"is already the shard count before step {r.at_step}, so nothing would move",
                            f"pick another count than {before}, or remove this resize")
        before, last_step = r.shards, r.at_step
