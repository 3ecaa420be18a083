"""Building blocks every job-file section shares: bounded number types, the strict section base, divisor hints."""

from __future__ import annotations

import math
import os
import threading
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from workers.parallel.schedules import SCHEDULE_NAMES

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
MAX_SLOWDOWN = 1e4
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
# a name handed to another tool (an MLflow experiment, a W&B project): "" fails there, after the actors started
NonEmptyStr = Annotated[str, Field(min_length=1)]

_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_:[]%")


def _host(value: str) -> str:
    """An interface address to bind: an IP address or a host name, nothing else. Why: an empty string binds every
    interface (gRPC's ``:port``, ``http.server``'s ``""``), so a blank ``host:`` would open a port to the network
    that nobody asked for; a scheme or port in it fails only when the server starts, after the actors."""
    fix = "; fix: write 127.0.0.1 (this machine only), or 0.0.0.0 or the node's IP to let other machines in"
    if not value.strip():
        raise ValueError(f"is empty, which would listen on every interface{fix}")
    bad = sorted(set(value) - _HOST_CHARS)
    if bad or value.count(":") == 1:  # one colon: host:port; an IPv6 address has two or more
        what = f"holds {''.join(bad)!r}" if bad else "holds a port (the port has its own field)"
        raise ValueError(f"{what}: it must be an IP address or a host name, without scheme or port{fix}")
    return value


Host = Annotated[str, AfterValidator(_host)]

# the names of workers.parallel.schedules' table, in its order (the order an unknown name's error lists them)
PipelineSchedule = Literal[SCHEDULE_NAMES]  # type: ignore[valid-type]
_SECTIONS = ("model", "data", "parallel", "optim", "precision", "memory", "train", "eval", "checkpoint", "metrics",
             "fault_tolerance", "parameter_server", "control", "plan", "loggers")


def _divisors(n: int, limit: int = 10**12) -> list[int]:
    """Divisors of `n` for fix hints, by trial division up to its square root; past `limit` (a size no job has)
    only the divisors up to 10**6 and their partners, so a huge value in a job file cannot hang validation."""
    top = math.isqrt(n) if n <= limit else 10**6
    small = [d for d in range(1, top + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _near_multiples(n: int, k: int) -> list[int]:
    """Multiples of `k` just below and above `n`, as concrete suggestions."""
    below = n // k * k
    return [m for m in (below, below + k) if m > 0]


class _Section(BaseModel):
    """Base for every section: unknown keys are errors, never silently ignored; types are strict (`STRICT`)."""

    model_config = STRICT
