"""Byte sizes as people write them (``80GB``, ``80GiB``) and as the planner's reports print them.

Ground for every layer: the job file's size fields (``orchestrator.spec``), the planner, placement and the CLI read
and print sizes the same way.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_bytes(text: str | int | float) -> int:
    """``80GB`` (decimal), ``80GiB`` (binary), ``8.5e10`` or a plain number of bytes -> int."""
    if isinstance(text, (int, float)):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 80GB, 80GiB or 85899345920")
    return int(float(match.group(1)) * _UNITS[unit])


def human_bytes(n: float) -> str:
    """Decimal units, as the ZeRO paper writes them (120 GB = 120e9 bytes)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
