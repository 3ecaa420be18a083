"""The value types of job-file fields (bounded numbers, paths, seeds) and the strict base every section takes.

Here, beside the sections the ranks read (``workers.contract.sections``), so a bound is declared once for the
controller that validates a job file and the rank that parses the dict it is sent; torch-free.
"""

from __future__ import annotations

import os
import threading
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from workers.contract.schedules import SCHEDULE_NAMES

# the OS's limits for one path and one name in it (Linux: 4096 and 255 bytes)
PATH_MAX = os.pathconf("/", "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096
NAME_MAX = os.pathconf("/", "PC_NAME_MAX") if hasattr(os, "pathconf") else 255
# strict: no bool for a number, no "4" for 4, no 2.5 for a whole number; finite floats only (no inf, no nan)
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Beta = Annotated[float, Field(ge=0, lt=1)]
# a wait longer than this is refused by Python's own timers (threading.TIMEOUT_MAX, ~292 years on Linux)
TIMEOUT_MAX = threading.TIMEOUT_MAX
Seconds = Annotated[float, Field(gt=0, le=TIMEOUT_MAX)]
Seed = Annotated[int, Field(ge=0, lt=2**63)]  # numpy's generators take no negative seed, torch none past 64 bits


def _list_as_tuple(value: Any) -> Any:
    """YAML has no tuples: strict mode takes a tuple only, so a fixed-size list becomes one first."""
    return tuple(value) if isinstance(value, list) else value


Betas = Annotated[tuple[Beta, Beta], BeforeValidator(_list_as_tuple)]


def _os_path(value: str | None) -> str | None:
    """A path the OS can create: no NUL byte, at most PATH_MAX bytes, no part longer than NAME_MAX bytes."""
    if value is None:
        return value
    if "\x00" in value:
        raise ValueError("holds a NUL byte, which no file name can contain")
    size = len(os.fsencode(value))
    if size >= PATH_MAX:
        raise ValueError(f"is {size} bytes long, over the OS limit PATH_MAX={PATH_MAX}")
    long = next((part for part in value.split(os.sep) if len(os.fsencode(part)) > NAME_MAX), None)
    if long is not None:
        raise ValueError(f"has a name of {len(os.fsencode(long))} bytes, over the OS limit NAME_MAX={NAME_MAX}")
    return value


PathStr = Annotated[str, Field(min_length=1), AfterValidator(_os_path)]

# the names of workers.contract.schedules' table, in its order (the order an unknown name's error lists them)
PipelineSchedule = Literal[SCHEDULE_NAMES]  # type: ignore[valid-type]


class Section(BaseModel):
    """Base for every section: unknown keys are errors, never silently ignored; types are strict (`STRICT`)."""

    model_config = STRICT
