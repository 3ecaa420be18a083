"""The fields a job file may leave unset for raymesh to pick (``memory.recompute``, ``train.compile``): what they
hold until the pick and how a spec remembers that they were unset.

A spec fills an unset field with its CPU default (what every job ran before raymesh picked: none, off), so every
check and the planner read a value; it remembers the field (``JobSpec.unset_fields``) and writes it back as unset
(``null``) in ``to_dict``, so a spec sent to a hosted controller is still picked for there. On a GPU the
controller replaces them with the fast settings the planner picks (``orchestrator.planning.fast_defaults``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec

# field path -> its value on a CPU, where nothing is picked
CPU_DEFAULTS = {"memory.recompute": "none", "train.compile": False}


def unset_fields(job: JobSpec) -> frozenset[str]:
    """Which of ``CPU_DEFAULTS``' fields ``job`` holds as ``None``."""
    return frozenset(path for path in CPU_DEFAULTS if value_of(job, path) is None)


def with_values(job: JobSpec, values: dict[str, object]) -> JobSpec:
    """``job`` with the ``values`` (field path -> value) of its pickable fields replaced (a copy, not validated)."""
    update = {}
    for path, value in values.items():
        section, field = path.split(".")
        current = update.get(section, getattr(job, section))
        update[section] = current.model_copy(update={field: value})
    return job.model_copy(update=update)


def fill_cpu_defaults(job: JobSpec, unset: frozenset[str]) -> None:
    """Put the CPU defaults in ``job``'s ``unset`` fields, in place."""
    filled = with_values(job, {path: CPU_DEFAULTS[path] for path in unset})
    for section in {path.split(".")[0] for path in unset}:
        setattr(job, section, getattr(filled, section))


def as_unset(raw: dict, unset: frozenset[str]) -> dict:
    """``raw`` (a spec's ``to_dict``) with the ``unset`` fields written back as ``None``."""
    for path in unset:
        section, field = path.split(".")
        raw[section][field] = None
    return raw


def value_of(job: JobSpec, path: str):
    """The value ``job`` holds at ``path`` (``section.field``)."""
    section, field = path.split(".")
    return getattr(getattr(job, section), field)
