"""Every number field of the job file, found by walking the spec's models (so a field added tomorrow is covered
without editing this test), refuses nan, inf, a boolean, a quoted number and a list, naming the field.

The fuzzer (tests/support/spec_fuzz.py) mutates the fields of one base job; this sweep reaches the nested sections
that job leaves out (rope scaling, YaRN, the MoE router, batch ramps, ...), where a section model declared without
the strict config once took ``inf`` and ``"4"``."""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel

from orchestrator import JobSpec
from orchestrator.errors import SpecError

# sections with required fields: a valid value for each, so the swept field's error is the only one
REQUIRED_SIBLINGS = {("train", "batch_ramp"): {"start": 2, "steps": 4}}
BAD_VALUES = (float("nan"), float("inf"), True, "4", [1])


def _leaf_types(annotation) -> list:
    """The types a field's annotation allows, Optional and Annotated unwrapped."""
    out = []
    for arg in typing.get_args(annotation) or (annotation,):
        if typing.get_origin(arg) is typing.Annotated:
            arg = typing.get_args(arg)[0]
        out.append(arg)
    return out


def numeric_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()):
    """(path, whether it also takes text) of every int or float field under ``model``, nested sections included
    (list items excluded: ``faults`` and the PS resizes have their own tests)."""
    for name, info in model.model_fields.items():
        key = info.alias or name
        if typing.get_origin(info.annotation) is list:
            continue
        leaves = _leaf_types(info.annotation)
        for leaf in leaves:
            if isinstance(leaf, type) and issubclass(leaf, BaseModel):
                yield from numeric_fields(leaf, (*prefix, key))
        if any(leaf in (int, float) for leaf in leaves):
            yield (*prefix, key), str in leaves


TAKES_TEXT = dict(numeric_fields(JobSpec))  # path -> whether the field also takes text ("80GB")
FIELDS = sorted(TAKES_TEXT)


def _job_with(path: tuple[str, ...], value) -> dict:
    raw: dict = {"data": {"path": "data/stdlib"}}
    section = raw
    for depth, key in enumerate(path[:-1]):
        section = section.setdefault(key, dict(REQUIRED_SIBLINGS.get(path[:depth + 1], {})))
    section[path[-1]] = value
    return raw


def test_the_sweep_reaches_nested_sections():
    assert len(FIELDS) > 100
    for nested in (("model", "rope_scaling", "factor"), ("model", "rope_yarn", "beta_slow"),
                   ("model", "moe", "experts"), ("train", "batch_ramp", "steps")):
        assert nested in FIELDS, nested


@pytest.mark.parametrize("path", FIELDS, ids=".".join)
def test_every_number_field_refuses_non_numbers_by_name(path):
    for value in BAD_VALUES:
        if TAKES_TEXT[path] and isinstance(value, str):
            continue
        with pytest.raises(SpecError) as caught:
            JobSpec.from_dict(_job_with(path, value))
        message = str(caught.value)
        assert ".".join(path) in message and "fix:" in message, (value, message)
