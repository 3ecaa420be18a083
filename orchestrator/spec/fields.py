"""Building blocks every job-file section shares: the value types (declared in ``workers.contract.fields``, beside
the sections the ranks read), the driver's own (hosts, names), the strict section base, divisor hints."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import AfterValidator, Field

from workers.contract.fields import (
    NAME_MAX,
    PATH_MAX,
    STRICT,
    TIMEOUT_MAX,
    Betas,
    PathStr,
    PipelineSchedule,
    PositiveFloat,
    PositiveInt,
    Seconds,
    Section,
    Seed,
)

__all__ = ["MAX_SLOWDOWN", "NAME_MAX", "PATH_MAX", "STRICT", "TIMEOUT_MAX", "Betas", "Host", "NonEmptyStr",
           "PathStr", "PipelineSchedule", "PositiveFloat", "PositiveInt", "Seconds", "Seed", "_Section", "changed"]

MAX_SLOWDOWN = 1e4
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


_Section = Section  # the driver's sections not shared with the ranks take the same strict base


def changed(section, field: str) -> bool:
    """Whether ``field`` differs from its default (a value, not ``model_fields_set``: specs round-trip through
    ``to_dict``, which writes every field)."""
    return getattr(section, field) != type(section).model_fields[field].default
