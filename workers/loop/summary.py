"""What ranks reduce up the exchange tree after a step or a save: partial summaries that merge in any grouping.

``merge`` is associative and commutative, so rank 0 gets the same summary whatever tree shape the exchange
uses and however many ranks one participant (a virtual host) steps (sums of phase times are float sums, equal
up to their last bit); and a summary's size does not grow with the
ranks it covers: sums, maxima and the lowest rank's values for the core fields, each figure's own partial for the
extras (``workers.contract.figures``), and, only on the steps that carry it (``Window.detail_every``), each rank's own
phase times and memory. The loss is a mean kept exactly (``figures.Mean``), so it is ``statistics.fmean`` of
the ranks' losses bit for bit, as the controller always recorded it. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from workers.contract.figures import FIGURES, Mean, merge_partials
from workers.protocol import PHASES, StepResult

_MEAN = Mean("loss", recorded=False)


@dataclass(frozen=True)
class SaveState:
    """An asynchronous save in flight on some ranks: of ``step``, whether every rank merged here has it written
    (``done``), and the first failure among them (``error``, naming the rank)."""

    step: int
    done: bool
    error: str | None = None

    def merge(self, other: SaveState | None) -> SaveState:
        if other is None:
            return self
        return SaveState(self.step, self.done and other.done, _first(self.error, other.error))


@dataclass(frozen=True)
class RankDetail:
    """One rank's own figures of a step: its phase times and memory (what ``steps.jsonl`` keeps per rank)."""

    phases: dict[str, float]
    peak_bytes: int
    current_bytes: int


@dataclass(frozen=True)
class StepSummary:
    """Every rank's result of one step, reduced (see the module docstring).

    ``first``: the lowest rank's (rank, grad norm, lr, whether it ran asp/ssp rounds), what the records take from
    rank 0; ``loss``/``norms``: exact means of the losses reported (the last stage's) and, under asp/ssp, of the
    finite grad norms; ``phases``: per phase (sum, max) over the ranks; ``slowest``: the two longest steps as
    (seconds, rank); ``bubble``: (sum of each pipelined rank's idle share of its window, how many); ``peak``: the
    highest peak memory and its rank; ``replicated``: the snapshot step every rank's holder has acknowledged.
    """

    step: int
    ranks: int
    first: tuple[int, float, float, bool]
    loss: tuple | None
    norms: tuple | None
    applied: bool
    phases: dict[str, tuple[float, float]]
    slowest: tuple[tuple[float, int], ...]
    bubble: tuple[float, int]
    peak: tuple[int, int]
    current: int
    replicated: int
    extras: dict
    detail: dict[int, RankDetail] | None = None
    saving: SaveState | None = None
    preempted: tuple[int, ...] = ()  # ranks whose process was told to go (SIGTERM): a checkpoint now, then out

    @classmethod
    def of(cls, result: StepResult, detail: bool = True, saving: SaveState | None = None,
           preempted: bool = False) -> StepSummary:
        """One rank's result as a partial (with its own phases and memory when ``detail``; ``preempted``: its
        process had a preemption notice)."""
        t = result.time_s
        asp = result.extras.get("local_steps") is not None
        window = t.bubble + t.compute
        return cls(
            step=result.step, ranks=1, first=(result.rank, result.grad_norm, result.lr, asp),
            loss=None if result.loss is None else _MEAN.lift(result.loss, result.rank),
            norms=_MEAN.lift(result.grad_norm, result.rank) if asp and math.isfinite(result.grad_norm) else None,
            applied=result.applied,
            phases={p: (getattr(t, p), getattr(t, p)) for p in PHASES},
            slowest=((t.step, result.rank),), bubble=(t.bubble / window, 1) if window > 0 else (0.0, 0),
            peak=(result.peak_memory_bytes, result.rank), current=result.current_memory_bytes,
            replicated=result.replicated_step,
            extras={k: FIGURES[k].lift(v, result.rank) for k, v in result.extras.items()},
            detail={result.rank: RankDetail(t.to_dict(), result.peak_memory_bytes, result.current_memory_bytes)}
            if detail else None,
            saving=saving, preempted=(result.rank,) if preempted else ())

    @classmethod
    def of_all(cls, results, detail: bool = True, saving: SaveState | None = None) -> StepSummary:
        """Several ranks' results merged (a participant stepping more than one rank; the tests)."""
        summaries = [cls.of(r, detail) for r in sorted(results, key=lambda r: r.rank)]
        merged = summaries[0]
        for s in summaries[1:]:
            merged = merged.merge(s)
        return merged if saving is None else replace(merged, saving=saving)

    def merge(self, other: StepSummary) -> StepSummary:
        detail = None if self.detail is None or other.detail is None else {**self.detail, **other.detail}
        return StepSummary(
            step=self.step, ranks=self.ranks + other.ranks, first=min(self.first, other.first, key=lambda f: f[0]),
            loss=_mean(self.loss, other.loss), norms=_mean(self.norms, other.norms),
            applied=self.applied and other.applied,
            phases={p: (a[0] + other.phases[p][0], max(a[1], other.phases[p][1])) for p, a in self.phases.items()},
            slowest=tuple(sorted((*self.slowest, *other.slowest), key=lambda s: (-s[0], s[1]))[:2]),
            bubble=(self.bubble[0] + other.bubble[0], self.bubble[1] + other.bubble[1]),
            peak=max(self.peak, other.peak, key=lambda p: (p[0], -p[1])), current=max(self.current, other.current),
            replicated=min(self.replicated, other.replicated), extras=merge_partials(self.extras, other.extras),
            detail=detail,
            saving=other.saving if self.saving is None else self.saving.merge(other.saving),
            preempted=tuple(sorted({*self.preempted, *other.preempted})))

    @property
    def finite(self) -> bool:
        """Whether every loss reported is a finite number (a NaN or inf fails the step on every rank)."""
        return self.loss is None or math.isfinite(_MEAN.value(self.loss))

    @property
    def mean_loss(self) -> float | None:
        return None if self.loss is None else _MEAN.value(self.loss)

    @property
    def grad_norm(self) -> float:
        """The step's gradient norm before clipping: rank 0's (all-reduce and bsp: every rank holds the job's one
        norm); under asp/ssp, where each replica clipped its own local steps, the mean of the ranks' finite norms
        (NaN when no replica applied a step)."""
        if not self.first[3]:
            return self.first[1]
        return float("nan") if self.norms is None else _MEAN.value(self.norms)

    @property
    def lr(self) -> float:
        return self.first[2]

    def phase_means(self) -> dict[str, float]:
        return {p: total / self.ranks for p, (total, _) in self.phases.items()}

    def phase_maxima(self) -> dict[str, float]:
        return {p: most for p, (_, most) in self.phases.items()}

    @property
    def bubble_ratio(self) -> float:
        """Idle share of the pipeline window, averaged over the ranks that had one (0 without a pipeline)."""
        total, ranks = self.bubble
        return total / ranks if ranks else 0.0


def _mean(a: tuple | None, b: tuple | None) -> tuple | None:
    if a is None or b is None:
        return a or b
    return _MEAN.merge(a, b)


@dataclass(frozen=True)
class SaveOutcome:
    """How a save the ranks just made (or an asynchronous one they just finished) went: ``error`` is the first
    failure, naming the rank and the cause; ``finished`` an earlier asynchronous save waited for first."""

    step: int
    error: str | None = None
    finished: SaveState | None = None
    saved: bool = False  # a save of ``step`` was made (False: only an asynchronous one was finished)

    def merge(self, other: SaveOutcome) -> SaveOutcome:
        finished = other.finished if self.finished is None else self.finished.merge(other.finished)
        return SaveOutcome(self.step, _first(self.error, other.error), finished, self.saved or other.saved)


def _first(a: str | None, b: str | None) -> str | None:
    """The error of the lower rank (errors start ``rank N:``), so the merged error is the same in any grouping."""
    if a is None or b is None:
        return a or b
    return min(a, b, key=_rank_of)


def _rank_of(error: str) -> tuple[int, str]:
    head = error.split(":", 1)[0]
    number = head.removeprefix("rank ").strip()
    return (int(number) if number.isdigit() else 1 << 62, error)
