"""Arithmetic on recorded pipeline events (torch-free, shared with the orchestrator's reports)."""

from __future__ import annotations


def busy_seconds(events: list[dict]) -> float:
    """Length of the union of the events' ``[start, end]`` intervals: overlapping events count once."""
    total, reach = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["start"]):
        start = max(e["start"], reach)
        if e["end"] > start:
            total += e["end"] - start
        reach = max(reach, e["end"])
    return total
