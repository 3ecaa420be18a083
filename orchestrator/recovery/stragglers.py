"""Straggler detection: a rank whose step time stays above ``straggler_ratio`` × the others' median.

Each rank reports its own step time (``time_s.step``); a rank is compared
with the median of the *other* ranks, so one slow rank of two still stands
out. It is reported after ``straggler_steps`` consecutive slow steps and
cleared after as many normal ones, so one noisy step neither raises nor
clears it. Reported only (event line, metric, summary): the step already
waits for the slowest rank, so there is nothing to roll back. Written here
because neither Ray nor PyTorch watches per-rank step times.
"""

from __future__ import annotations

from orchestrator.events import event
from workers.loop.summary import StepSummary


class StragglerDetector:
    def __init__(self, ratio: float, steps: int):
        self.ratio = ratio
        self.steps = steps
        self.slow_run: dict[int, int] = {}  # rank -> consecutive slow steps
        self.calm_run: dict[int, int] = {}  # rank -> consecutive normal steps while reported
        self.open: dict[int, dict] = {}  # rank -> its current episode
        self.episodes: list[dict] = []  # every episode, for the summary's `stragglers`

    def observe_summary(self, step: int, summary: StepSummary) -> dict[int, float]:
        """``observe`` on a step with per-rank detail; on one without, the slowest rank's time over the other
        ranks' mean (their median is not in a reduced summary), and every other rank counts as calm when even the
        second slowest is within the ratio (nothing is known of them otherwise). Returns the ratios it knows."""
        if summary.detail is not None:
            return self.observe(step, {rank: d.phases["step"] for rank, d in summary.detail.items()})
        (slowest, rank), *rest = summary.slowest
        others = (summary.phases["step"][0] - slowest) / max(summary.ranks - 1, 1)
        ratios = {rank: slowest / others if others > 0 else 1.0}
        self._update(step, rank, ratios[rank])
        second = rest[0][0] / others if rest and others > 0 else 1.0
        if second <= self.ratio:
            for other in {*self.open, *(r for r, n in self.slow_run.items() if n)} - {rank}:
                self._update(step, other, second)
        return ratios

    def observe(self, step: int, times: dict[int, float]) -> dict[int, float]:
        """Each rank's step time over the other ranks' median for ``step``; updates what is reported."""
        ratios = {}
        order = sorted(times, key=times.get)
        values = [times[r] for r in order]
        for i, rank in enumerate(order):
            seconds = values[i]
            median = _median_without(values, i) if len(values) > 1 else seconds
            ratios[rank] = seconds / median if median > 0 else 1.0
            self._update(step, rank, ratios[rank])
        return ratios

    def _update(self, step: int, rank: int, ratio: float) -> None:
        slow = ratio > self.ratio
        self.slow_run[rank] = self.slow_run.get(rank, 0) + 1 if slow else 0
        episode = self.open.get(rank)
        if episode is None:
            if self.slow_run[rank] >= self.steps:
                episode = {"rank": rank, "since_step": step - self.steps + 1, "until_step": None, "max_ratio": ratio}
                self.open[rank] = episode
                self.episodes.append(episode)
                self.calm_run[rank] = 0
                event("straggler", rank=rank, since_step=episode["since_step"], ratio=f"{ratio:.2f}",
                      threshold=f"{self.ratio:.2f}")
            return
        episode["max_ratio"] = max(episode["max_ratio"], ratio)
        self.calm_run[rank] = 0 if slow else self.calm_run[rank] + 1
        if self.calm_run[rank] >= self.steps:
            episode["until_step"] = step - self.steps
            del self.open[rank]
            event("straggler_cleared", rank=rank, until_step=episode["until_step"],
                  max_ratio=f"{episode['max_ratio']:.2f}")

    def flagged(self) -> set[int]:
        return set(self.open)


def _median_without(values: list[float], i: int) -> float:
    """The median of sorted ``values`` less the one at ``i``, in O(1): a list of the others per rank made each
    step with per-rank detail quadratic in the ranks (11 s at 16,384)."""
    m = len(values) - 1

    def other(j: int) -> float:
        return values[j] if j < i else values[j + 1]

    return other(m // 2) if m % 2 else (other(m // 2 - 1) + other(m // 2)) / 2
