"""How many layers each pipeline stage holds: an even split, or PipeDream's dynamic program over profiled costs.

Torch-free, so the spec checks, the planner and the workers share it. A split is a tuple of layer counts, one
per stage (virtual stages included), in stage order; stage ``s`` holds the contiguous layers that follow the
previous stages' (``stage_bounds``). The embedding always sits on the first stage and the output head on the
last, so their costs are added there rather than being units the program may move.

``balanced_split`` is ours: PipeDream's partitioner (Narayanan et al. 2019; the seed article 000's
"profiler + dynamic program") is not in PyTorch, whose pipelining splits by hand-placed split points. We keep
its objective (the slowest stage, which sets the steady-state step) and its memory constraint, and leave out
its communication term: every stage boundary carries the same hidden-state tensor, so the term is the same
for every split.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

# (stage, first layer, end layer) -> bytes the stage would need with layers [first, end)
StageMemory = Callable[[int, int, int], float]


def even_split(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """``n_layers / n_stages`` layers a stage (the job spec refuses a count that does not divide)."""
    return (n_layers // n_stages,) * n_stages


def stage_bounds(split: Sequence[int]) -> list[range]:
    """The global layer indices of each stage of ``split``."""
    out, start = [], 0
    for count in split:
        out.append(range(start, start + count))
        start += count
    return out


def split_problem(split: Sequence[int], n_layers: int, n_stages: int) -> str | None:
    """Why ``split`` cannot cut ``n_layers`` layers into ``n_stages`` stages, or None when it can."""
    if len(split) != n_stages:
        return f"has {len(split)} entries but the pipeline has {n_stages} stages (one layer count per stage)"
    if any(count < 1 for count in split):
        return "has a stage with no layers; every stage holds at least one block"
    if sum(split) != n_layers:
        return f"sums to {sum(split)} layers but model.n_layers is {n_layers}"
    return None


def stage_cost(times: Sequence[float], split: Sequence[int], first: float = 0.0, last: float = 0.0) -> list[float]:
    """Each stage's cost under ``split``: its layers' ``times``, plus ``first`` (embedding) on the first stage
    and ``last`` (head) on the last."""
    costs = [sum(times[i] for i in layers) for layers in stage_bounds(split)]
    costs[0] += first
    costs[-1] += last
    return costs


def balanced_split(times: Sequence[float], n_stages: int, first: float = 0.0, last: float = 0.0,
                   memory: StageMemory | None = None, limit: float | None = None,
                   max_layers: Sequence[int] | None = None) -> tuple[int, ...]:
    """The contiguous split of ``len(times)`` layers into ``n_stages`` stages (each at least one layer) whose
    slowest stage is fastest, among those where every stage's ``memory(stage, first, end)`` is at most
    ``limit`` and stage ``s`` holds at most ``max_layers[s]`` layers (PipeDream's dynamic program, ``_program``).
    Ties keep fewer layers on the earlier stages. ``max_layers`` is what ``memory`` cannot say: a cap known up
    front, so the program visits only the cells the caps allow (the planner's search caps thousands of splits
    of 126 layers). Raises ValueError when no split fits.
    """
    n = len(times)
    if not 1 <= n_stages <= n:
        raise ValueError(f"balanced_split: {n} layers cannot fill {n_stages} stages of at least one layer each")
    if max_layers is not None and len(max_layers) != n_stages:
        raise ValueError(f"balanced_split: {len(max_layers)} layer caps for {n_stages} stages (one cap per stage)")
    prefix = list(itertools.accumulate(times, initial=0.0))

    def cost(stage: int, lo: int, hi: int) -> float:
        if memory is not None and limit is not None and memory(stage, lo, hi) > limit:
            return math.inf
        return prefix[hi] - prefix[lo] + (first if stage == 0 else 0.0) + (last if stage == n_stages - 1 else 0.0)

    caps = [min(max(cap, 0), n) for cap in max_layers] if max_layers is not None else [n] * n_stages
    # without memory a stage costs more the earlier it starts (no time is negative); memory may refuse a late
    # start and allow an earlier one
    slowest, start = _program(cost, n, caps, rising=memory is None and min(times) >= 0)
    if math.isinf(slowest):
        bounds = [f"within {limit} bytes"] * (limit is not None) + [f"at most {caps} layers"] * (
            max_layers is not None)
        raise ValueError(f"balanced_split: no split of {n} layers into {n_stages} stages keeps every stage "
                         f"{' and '.join(bounds)}")
    cuts = [n]
    for s in range(n_stages - 1, 0, -1):
        cuts.append(start[s][cuts[-1]])
    return tuple(b - a for a, b in itertools.pairwise([0, *reversed(cuts)]))


def _program(cost: Callable[[int, int, int], float], n: int, caps: list[int],
             rising: bool) -> tuple[float, list[list[int]]]:
    """PipeDream's table: ``best[s][j]``, the smallest slowest-stage cost of putting layers ``[0, j)`` on stages
    ``0..s`` with stage ``s`` ending at ``j``, and ``start[s][j]``, where that stage starts; O(stages x
    layers^2). Returns the whole split's cost, ``best[-1][n]``, and ``start``.

    Starts are scanned latest first, a tie going to the earlier start. Where ``rising`` (a stage's cost grows as
    it starts earlier), once a stage alone costs more than the best so far no earlier start can win, and the
    scan stops near the balance point (for the planner's splits of 126 layers, after a fifth to a half of the
    starts a whole scan reads)."""
    n_stages, ends = len(caps), _stage_ends(n, caps)
    best = [[math.inf] * (n + 1) for _ in range(n_stages)]
    start = [[0] * (n + 1) for _ in range(n_stages)]
    for j in ends[0]:
        best[0][j] = cost(0, 0, j)
    for s in range(1, n_stages):
        before, here = best[s - 1], best[s]
        for j in ends[s]:
            for i in reversed(range(max(ends[s - 1].start, j - caps[s]), min(ends[s - 1].stop, j))):
                stage = cost(s, i, j)
                if rising and stage > here[j]:
                    break
                value = max(before[i], stage)
                if value <= here[j] and value < math.inf:
                    here[j], start[s][j] = value, i
    return best[-1][n], start


def _stage_ends(n: int, caps: Sequence[int]) -> list[range]:
    """Where each stage may end in a split of ``n`` layers with at most ``caps[s]`` on stage ``s``: after the
    stages so far hold a layer each and no more than their caps, and before what the later stages must take (a
    layer each) and after what they cannot (more than their caps). Cells outside are either unreachable or
    lead to no whole split, so skipping them changes neither the optimum nor its tie-breaks; uncapped, these
    are the program's usual ``s + 1 .. n - stages + s + 1``."""
    stages, held = len(caps), list(itertools.accumulate(caps))
    return [range(max(s + 1, n - (held[-1] - held[s])), min(held[s], n - (stages - 1 - s)) + 1)
            for s in range(stages)]
