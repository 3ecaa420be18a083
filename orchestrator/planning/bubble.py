"""Pipeline bubble: the share of a step that pipeline ranks spend idle, measured and in theory.

Pure Python so the controller, the report and the tests can all use it without
matplotlib. Events are the records of ``timeline.jsonl``: ``{"step", "rank",
"pp_rank", "stage", "microbatch", "kind", "start", "end"}`` (times in seconds).
"""

from __future__ import annotations

from collections import defaultdict

from workers.diagnostics.timeline import busy_seconds


def theoretical_bubble(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of an ideal pipeline step: (p−1)/(v·m + p−1).

    For v=1 this is GPipe's (d−1)/(m+d−1) (the seed article 001, "pipeline
    bubble"); Megatron's PTD-P interleaving gives each rank v model chunks and
    divides the bubble time by v (seed 001, "Interleaved Pipeline Schedule"):
    bubble/ideal = (p−1)/(v·m), hence (p−1)/(v·m + p−1) of the whole step.
    """
    if pp < 1 or microbatches < 1 or virtual_stages < 1:
        raise ValueError(
            "theoretical_bubble needs pp, microbatches, virtual_stages >= 1; "
            f"got {pp}, {microbatches}, {virtual_stages}"
        )
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


def measured_bubble(events: list[dict]) -> float:
    """Mean over pp ranks of the idle share of the step window [first start, last end].

    ``events`` must be one step of one replica (one rank per pp rank, see
    :func:`step_events`); busy time is the union of a rank's intervals, so
    overlapping events (e.g. W running beside B) are not counted twice.
    """
    if not events:
        raise ValueError("measured_bubble needs at least one event")
    lo = min(e["start"] for e in events)
    hi = max(e["end"] for e in events)
    window = hi - lo
    if window <= 0:
        return 0.0
    by_pp: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        by_pp[e["pp_rank"]].append(e)
    idle = [1.0 - busy_seconds(rank_events) / window for rank_events in by_pp.values()]
    return sum(idle) / len(idle)


def ordered_bubble(events: list[dict]) -> float:
    """The bubble the recorded order alone leaves: each pp rank's events replayed in the order they started, at
    ideal costs (a forward 1, a backward 2, or 1 and 1 when the schedule splits the weight gradient off into W
    passes; each divided by the rank's stage count), with no time for messaging.

    Why: on a small model the measured bubble is mostly messaging between stages and this machine's noise, so
    two schedules' measured bubbles can swap places from run to run. This one is what the schedule as it ran
    costs (GPipe and 1F1B give exactly (p−1)/(m+p−1), interleaving divides it by v), and measured minus it is
    what the machine added. Dependencies: a stage's forward waits for the previous stage's, its backward for
    its own forward and the next stage's backward, a W for its backward (stages numbered in model order).
    Written here because PyTorch's pipelining has no simulator of an executed order.
    """
    if not events:
        raise ValueError("ordered_bubble needs at least one event")
    last = max(e["stage"] for e in events)
    queues: dict[int, list[dict]] = defaultdict(list)
    for e in sorted(events, key=lambda e: e["start"]):
        queues[e["pp_rank"]].append(e)
    split = any(e["kind"] == "W" for e in events)
    cost = {"F": 1.0, "B": 1.0 if split else 2.0, "W": 1.0}
    share = {p: 1.0 / len({e["stage"] for e in q}) for p, q in queues.items()}
    done: dict[tuple, float] = {}
    clock, busy = dict.fromkeys(queues, 0.0), dict.fromkeys(queues, 0.0)
    while any(queues.values()):
        moved = False
        for p, queue in queues.items():
            while queue:
                needs = _needs(queue[0], last)
                if any(d not in done for d in needs):
                    break
                e = queue.pop(0)
                took = cost[e["kind"]] * share[p]
                clock[p] = max([clock[p]] + [done[d] for d in needs]) + took
                busy[p] += took
                done[(e["kind"], e["stage"], e["microbatch"])] = clock[p]
                moved = True
        if not moved:
            stuck = {p: (q[0]["kind"], q[0]["stage"], q[0]["microbatch"]) for p, q in queues.items() if q}
            raise ValueError(f"ordered_bubble: the recorded order waits on itself (pp rank -> its next event "
                             f"(kind, stage, microbatch): {stuck}); one step of one synchronous pipeline only")
    span = max(clock.values())
    return sum(1.0 - b / span for b in busy.values()) / len(busy)


def _needs(event: dict, last_stage: int) -> list[tuple]:
    """The events (kind, stage, microbatch) that must end before ``event`` can start."""
    kind, stage, mb = event["kind"], event["stage"], event["microbatch"]
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind == "B":
        return [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < last_stage else [])
    return [("B", stage, mb)]


PIPELINE_KINDS = ("F", "B", "W")  # the timeline also holds "FB" (no pipeline) and "allreduce" (gradient buckets)


def step_events(timeline: list[dict], step: int) -> list[dict]:
    """The pipeline events of ``step`` for one data/tensor replica: the smallest rank of each pp rank.

    Every replica runs the same schedule, so one is enough and mixing several
    would double the events on a pp rank.
    """
    in_step = [e for e in timeline if e["step"] == step and e["kind"] in PIPELINE_KINDS]
    first_rank: dict[int, int] = {}
    for e in in_step:
        first_rank[e["pp_rank"]] = min(e["rank"], first_rank.get(e["pp_rank"], e["rank"]))
    return [e for e in in_step if e["rank"] == first_rank[e["pp_rank"]]]


def bubble_by_step(timeline: list[dict]) -> dict[int, float]:
    """Measured bubble of every step present in ``timeline``, keyed by step."""
    return {s: measured_bubble(step_events(timeline, s)) for s in sorted({e["step"] for e in timeline})}
