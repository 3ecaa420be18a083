"""Synthetic pipeline timelines: exact, dependency-respecting event lists for bubble and report tests.

Shared because the bubble math and the run report both need a timeline whose bubble is known in closed form.
"""

from __future__ import annotations

T0 = 1_700_000_000.0  # unix-like times; 0.25 s units keep every sum exact in float64


def gpipe_timeline(p: int, m: int, step: int = 1, f: float = 1.0, b: float = 2.0, dp: int = 1,
                   unit: float = 0.25, t0: float = T0, latency: float = 0.0) -> list[dict]:
    """Simulate GPipe with dependencies: all forwards, flush, then all backwards in reverse stage order.

    F(s, j) waits for F(s−1, j) and the rank's previous op; B(s, j) waits for
    B(s+1, j) and the rank's previous op, each plus ``latency`` (a message between stages).
    Rank = replica·p + stage (one stage per rank).
    """
    free = [0.0] * p
    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    ops: list[tuple[str, int, int, float, float]] = []
    for j in range(m):
        for s in range(p):
            start = max(free[s], f_end[s - 1, j] + latency if s else 0.0)
            free[s] = f_end[s, j] = start + f
            ops.append(("F", s, j, start, start + f))
    for j in range(m):
        for s in reversed(range(p)):
            start = max(free[s], b_end[s + 1, j] + latency if s < p - 1 else 0.0)
            free[s] = b_end[s, j] = start + b
            ops.append(("B", s, j, start, start + b))
    return [
        {"step": step, "rank": replica * p + s, "pp_rank": s, "stage": s, "microbatch": j, "kind": kind,
         "start": t0 + replica * 0.5 + start * unit, "end": t0 + replica * 0.5 + end * unit}
        for replica in range(dp) for kind, s, j, start, end in ops
    ]
