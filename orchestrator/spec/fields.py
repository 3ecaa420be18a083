"""Building blocks every job-file section shares: bounded number types, the strict section base, divisor hints."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from workers.parallel.schedules import SCHEDULE_NAMES

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Beta = Annotated[float, Field(ge=0, lt=1)]

# the names of workers.parallel.schedules' table, in its order (the order an unknown name's error lists them)
PipelineSchedule = Literal[SCHEDULE_NAMES]  # type: ignore[valid-type]
_SECTIONS = ("model", "data", "parallel", "optim", "precision", "memory", "train", "checkpoint", "metrics",
             "fault_tolerance", "parameter_server", "control")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _near_multiples(n: int, k: int) -> list[int]:
    """Multiples of `k` just below and above `n`, as concrete suggestions."""
    below = n // k * k
    return [m for m in (below, below + k) if m > 0]


class _Section(BaseModel):
    """Base for every section: unknown keys are errors, never silently ignored."""

    model_config = ConfigDict(extra="forbid")
