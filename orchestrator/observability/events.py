"""One human-readable line per event a user cares about (start, layout, checkpoint, finish)."""

from __future__ import annotations

import logging
import sys

_log = logging.getLogger("raymesh")
if not _log.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(asctime)s raymesh %(message)s", "%H:%M:%S"))
    _log.addHandler(_handler)
    _log.setLevel(logging.INFO)
    _log.propagate = False


def event(name: str, **fields) -> None:
    _log.info(" ".join([f"event={name}"] + [f"{k}={v}" for k, v in fields.items()]))
