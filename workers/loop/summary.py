"""What ranks reduce up the exchange tree after a step or a save: partial summaries that merge in any grouping.

``merge`` is associative and commutative, so rank 0 gets the same summary whatever tree shape the exchange
uses and however many ranks one participant (a virtual host) steps. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from workers.protocol import StepResult


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
class StepSummary:
    """The step results of the ranks merged so far, in rank order, and their asynchronous save."""

    results: tuple[StepResult, ...]
    saving: SaveState | None = None

    @classmethod
    def of(cls, results, saving: SaveState | None = None) -> StepSummary:
        return cls(tuple(sorted(results, key=lambda r: r.rank)), saving)

    def merge(self, other: StepSummary) -> StepSummary:
        saving = other.saving if self.saving is None else self.saving.merge(other.saving)
        return StepSummary.of((*self.results, *other.results), saving)

    @property
    def step(self) -> int:
        return self.results[0].step

    @property
    def finite(self) -> bool:
        """Whether every loss reported is a finite number (a NaN or inf fails the step on every rank)."""
        return all(r.loss is None or r.loss == r.loss and abs(r.loss) != float("inf") for r in self.results)

    @property
    def replicated(self) -> int:
        """The newest snapshot step every rank's holder has acknowledged: snapshots older than it can go."""
        return min(r.replicated_step for r in self.results)

    def with_results(self, results) -> StepSummary:
        return replace(self, results=tuple(results))


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
