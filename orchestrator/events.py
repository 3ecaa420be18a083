"""One human-readable line per event a user cares about (start, layout, checkpoint, finish).

A line is ``HH:MM:SS raymesh event=NAME key=value ...``. Values come from job
files, the cluster and control-API callers (a stop reason), and clients act on
these lines (``event=control address=...`` says where to send ``raymesh stop``),
so a value with whitespace, a control character or a leading quote is written
as a JSON string: no value can end its line or add a ``key=`` of its own.
``parse_event`` reads a line back, and only a whole line counts.
"""

from __future__ import annotations

import json
import logging
import re
import sys

from tqdm import tqdm


class AboveProgressBars(logging.StreamHandler):
    """Writes each line through ``tqdm.write``, which clears any progress bar on the stream, prints the line and
    redraws the bar below it: a plain stream handler would print into the bar's line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # logging's contract: a failed write never raises into the caller
            self.handleError(record)


_log = logging.getLogger("raymesh")
if not _log.handlers:
    _handler = AboveProgressBars(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(asctime)s raymesh %(message)s", "%H:%M:%S"))
    _log.addHandler(_handler)
    _log.setLevel(logging.INFO)
    _log.propagate = False

_VALUE = r'(?:"(?:[^"\\]|\\.)*"|[^\s"]\S*|)'
_LINE = re.compile(rf"^\d\d:\d\d:\d\d raymesh event=(\w+)((?: \w+={_VALUE})*)$")
_FIELD = re.compile(rf" (\w+)=({_VALUE})")


def escape(value) -> str:
    """``value`` as one token of an event line (quoted JSON when it could read as more than one)."""
    text = str(value)
    if text and text[0] != '"' and all(c.isprintable() and not c.isspace() for c in text):
        return text
    return json.dumps(text)


def event(name: str, **fields) -> None:
    _log.info(" ".join([f"event={name}"] + [f"{k}={escape(v)}" for k, v in fields.items()]))


def parse_event(line: str) -> tuple[str, dict[str, str]] | None:
    """(name, fields) of a whole event line as ``event`` writes it; None for any other line."""
    match = _LINE.match(line.rstrip("\r"))
    if match is None:
        return None
    fields = {key: json.loads(raw) if raw.startswith('"') else raw for key, raw in _FIELD.findall(match.group(2))}
    return match.group(1), fields
