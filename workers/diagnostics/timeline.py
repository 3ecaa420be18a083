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


def merged(events: list[dict]) -> list[tuple[float, float]]:
    """The union of the events' ``[start, end]`` intervals as disjoint sorted intervals."""
    out: list[tuple[float, float]] = []
    for e in sorted(events, key=lambda e: e["start"]):
        if out and e["start"] <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e["end"]))
        else:
            out.append((e["start"], e["end"]))
    return out


def overlap_fraction(comm: list[dict], compute: list[dict]) -> float:
    """Share of the communication events' time (their union) that runs while some compute event runs: 1.0 is
    fully hidden behind compute, 0.0 fully exposed (0.0 too when there is no communication)."""
    total = busy_seconds(comm)
    if total == 0:
        return 0.0
    busy = merged(compute)
    hidden = sum(max(0.0, min(c1, b1) - max(c0, b0)) for c0, c1 in merged(comm) for b0, b1 in busy)
    return hidden / total
