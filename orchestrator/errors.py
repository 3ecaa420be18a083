"""User-facing errors.

Every problem with a job file is reported as a `SpecError` that names the
field, the offending value and a concrete fix, so users never have to read
source code or a pydantic traceback to repair their job file.
"""

from __future__ import annotations

import reprlib
from typing import Any

# Sentinel for errors that have no meaningful value to show (e.g. a missing field).
NO_VALUE: Any = object()

_repr = reprlib.Repr()
_repr.maxstring = 80
_repr.maxother = 80
_repr.maxlist = 8
_repr.maxdict = 6


class SpecError(ValueError):
    """An invalid job file, override or runtime mismatch, with a fix.

    The message reads ``job file field `parallel.tp`: value 3 <problem>; fix: <fix>``.
    ``field`` is the dotted path (``None`` when the problem is not one field, such
    as an unreadable file); ``value`` is the offending value (``None`` when there
    is none); ``more`` counts further problems that were found but not shown.
    """

    def __init__(
        self,
        field: str | None,
        value: Any,
        problem: str,
        fix: str,
        *,
        where: str | None = None,
        more: int = 0,
    ) -> None:
        self.field = field
        self.value = None if value is NO_VALUE else value
        self.problem = problem
        self.fix = fix
        self.where = where
        self.more = more
        self._raw_value = value
        if where is None and field is not None:  # a command-line option (`--checkpoint`) is not a job-file field
            where = f"option `{field}`" if field.startswith("--") else f"job file field `{field}`"
        elif where is None:
            where = "job file"
        detail = problem if value is NO_VALUE else f"value {_repr.repr(value)} {problem}"
        message = f"{where}: {detail}; fix: {fix}"
        if more:
            plural = "s" if more > 1 else ""
            message += f" ({more} more problem{plural} found; re-run after fixing this one to see them)"
        super().__init__(message)

    def with_more(self, more: int) -> SpecError:
        """Return a copy that also reports how many other problems were found."""
        return SpecError(self.field, self._raw_value, self.problem, self.fix, where=self.where, more=more)
