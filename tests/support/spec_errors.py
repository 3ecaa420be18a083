"""Asserting that a job file is refused with an actionable message (field, value, fix)."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec


def spec_error(raw: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict(raw)
    return info.value


def assert_actionable(err: SpecError, field: str | None, value: Any, *fix_parts: str) -> str:
    """The message must name the field, show the value and carry a fix."""
    msg = str(err)
    assert err.field == field
    assert err.value == value
    if field is not None:
        assert f"`{field}`" in msg
    if value is not None:
        assert f"value {value!r}" in msg
    assert "; fix: " in msg and err.fix and err.fix in msg
    for part in fix_parts:
        assert part in err.fix, (part, err.fix)
    return msg
