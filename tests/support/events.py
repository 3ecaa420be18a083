"""The controller's ``event=`` lines as a test sees them: recorded while a job runs, parsed into fields."""

from __future__ import annotations

import logging
from contextlib import contextmanager

from orchestrator.events import parse_event


@contextmanager
def recorded_events():
    """The ``event=`` lines logged while the block runs, parsed into (name, fields)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.setFormatter(logging.getLogger("raymesh").handlers[0].formatter)  # whole lines, as users see them
    handler.emit = lambda record: lines.append(handler.format(record))
    logging.getLogger("raymesh").addHandler(handler)
    parsed: list[tuple[str, dict]] = []
    try:
        yield parsed
    finally:
        logging.getLogger("raymesh").removeHandler(handler)
        parsed.extend(e for e in map(parse_event, lines) if e is not None)
