"""One reducer per per-step figure: how the ranks' ``StepResult.extras`` entries become one ``steps.jsonl`` record.

A rank's step result keeps its core fields (loss, norm, times, memory now) and puts every feature's figure in
``extras`` under the figure's key (``memory``, ``timeline``, ``moe``, ``comm_bytes``, ``eval_loss`` ...). Each key
has ONE ``Figure`` here, which the controller folds over the ranks:

- ``lift(value, rank)``: one rank's value as a partial (e.g. a mean's (sum, count));
- ``merge(a, b)``: two partials as one. Associative and commutative, so a tree of merges over any split of the
  ranks gives what one fold over all of them gives (the in-band reduction of step results up a tree relies on it);
- ``record(merged)``: the entries the ``steps.jsonl`` line carries for it (none for a figure that only the run
  records' other files or the summary read), exactly the keys and numbers the records always had.

Why a registry and not a field per feature: a new figure is one ``register(...)`` beside the hook that makes it,
not a field, a branch in ``step_record`` and one in each observer. Torch-free: the controller imports it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any


class Figure:
    """The reducer of one ``extras`` key (see the module docstring); subclasses define ``merge``."""

    def __init__(self, key: str, recorded: bool = True):
        """``recorded``: whether the ``steps.jsonl`` line carries the figure under ``key`` (else it only reaches
        the controller's other readers through ``fold``, e.g. per-rank memory or pipeline events)."""
        self.key, self.recorded = key, recorded

    def lift(self, value: Any, rank: int) -> Any:
        """One rank's value as a partial of the fold (most figures merge their values as they are)."""
        return value

    def merge(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def value(self, merged: Any) -> Any:
        """The merged figure as its readers use it (a mean's number, not its (sum, count))."""
        return merged

    def record(self, merged: Any) -> dict[str, Any]:
        """The ``steps.jsonl`` entries of the merged figure: ``{key: value}``, or none when not recorded."""
        return {self.key: self.value(merged)} if self.recorded else {}


class Sum(Figure):
    def merge(self, a, b):
        return a + b


class Max(Figure):
    def merge(self, a, b):
        return max(a, b)


class MaxPerKey(Figure):
    """Per entry of a dict, the most any rank reported (an absent entry counts 0); recorded when non-empty."""

    def merge(self, a: dict, b: dict) -> dict:
        return {k: max(a.get(k, 0), b.get(k, 0)) for k in dict.fromkeys([*a, *b])}

    def record(self, merged: dict) -> dict[str, Any]:
        return {self.key: merged} if merged else {}


class Union(Figure):
    """The union of the ranks' dicts, whose shared entries are equal (e.g. an MoE layer's figures, already summed
    over data parallelism, on every rank holding the layer); recorded when non-empty."""

    def merge(self, a: dict, b: dict) -> dict:
        return {**a, **b}

    def record(self, merged: dict) -> dict[str, Any]:
        return {self.key: merged} if merged else {}


class ByRank(Figure):
    """Each rank's value kept under its rank (per-rank measured memory)."""

    def lift(self, value, rank: int) -> dict[int, Any]:
        return {rank: value}

    def merge(self, a: dict, b: dict) -> dict:
        return dict(sorted({**a, **b}.items()))


class RankOrdered(Figure):
    """Lists of events, each naming its ``rank``, concatenated in rank order (a stable sort: each rank's own
    order kept), as the ranks' lists one after the other are."""

    def merge(self, a: list, b: list) -> list:
        return sorted([*a, *b], key=lambda event: event["rank"])


class LowestRank(Figure):
    """A figure every rank reports alike (or should): the lowest rank's value, as a scan of the ranks in order
    would take the first one."""

    def lift(self, value, rank: int) -> tuple[int, Any]:
        return rank, value

    def merge(self, a: tuple, b: tuple) -> tuple:
        return min(a, b, key=lambda pair: pair[0])

    def value(self, merged: tuple) -> Any:
        return merged[1]


class Mean(Figure):
    """The mean of the ranks' values, bit for bit ``statistics.fmean`` of them: the finite values' sum is kept
    exact (a ``Fraction``; a float sum would depend on the merge tree's shape), non-finite ones as a float sum."""

    def lift(self, value: float, rank: int) -> tuple[Fraction, float, int]:
        return (Fraction(value), 0.0, 1) if math.isfinite(value) else (Fraction(0), value, 1)

    def merge(self, a: tuple, b: tuple) -> tuple:
        return a[0] + b[0], a[1] + b[1], a[2] + b[2]

    def value(self, merged: tuple) -> float:
        exact, special, count = merged
        return (float(exact) + special) / count  # float(Fraction) rounds once, as fsum does


class PSTraffic(Figure):
    """Under ``dp_sync: ps``: every rank's push and pull bytes summed, and the stalest read any rank made."""

    def lift(self, value: dict, rank: int) -> dict:
        return {"push_bytes": value["push"], "pull_bytes": value["pull"], "staleness": value["staleness"]}

    def merge(self, a: dict, b: dict) -> dict:
        return {"push_bytes": a["push_bytes"] + b["push_bytes"], "pull_bytes": a["pull_bytes"] + b["pull_bytes"],
                "staleness": max(a["staleness"], b["staleness"])}


FIGURES: dict[str, Figure] = {}


def register(figure: Figure, replace: bool = False) -> Figure:
    """Add ``figure`` under its key (``replace``: over one registered before, e.g. by a test's fixture)."""
    if figure.key in FIGURES and not replace:
        raise ValueError(f"step figure {figure.key!r} is registered already ({FIGURES[figure.key]!r}); "
                         "pick another key, or pass replace=True")
    FIGURES[figure.key] = figure
    return figure


def unregister(key: str) -> None:
    """Remove the figure under ``key`` (a test's own, after the test)."""
    FIGURES.pop(key, None)


def check_keys(keys: Iterable[str]) -> None:
    """Refuse an ``extras`` key that no figure reduces: the controller could not record it."""
    unknown = [k for k in keys if k not in FIGURES]
    if unknown:
        raise TypeError(f"StepResult extras {unknown} have no registered step figure (known: {sorted(FIGURES)}); "
                        "register a Figure for them in workers/contract/figures.py (or from the hook's module)")


def fold(results: Iterable[Any]) -> dict[str, Any]:
    """Every figure's partial over ``results`` (``StepResult``s: ``rank`` and ``extras``), lifted and merged."""
    merged: dict[str, Any] = {}
    for result in results:
        merged = merge_partials(merged, {k: FIGURES[k].lift(v, result.rank) for k, v in result.extras.items()})
    return merged


def merge_partials(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two folds (over disjoint sets of ranks) as one: the step of a reduction tree."""
    out = dict(a)
    for key, part in b.items():
        out[key] = FIGURES[key].merge(out[key], part) if key in out else part
    return out


def record_entries(merged: Mapping[str, Any]) -> dict[str, Any]:
    """The ``steps.jsonl`` entries of a fold, in the registry's order."""
    out: dict[str, Any] = {}
    for key, figure in FIGURES.items():
        if key in merged:
            out.update(figure.record(merged[key]))
    return out


def figure_value(merged: Mapping[str, Any], key: str) -> Any:
    """The merged value of one figure, None when no rank reported it."""
    return FIGURES[key].value(merged[key]) if key in merged else None


for _figure in (
    ByRank("memory", recorded=False),  # memory.measure: per rank, model state and activation bytes
    RankOrdered("timeline", recorded=False),  # metrics.timeline: pipeline and bucket events (timeline.jsonl)
    Sum("local_steps", recorded=False),  # asp/ssp: local steps the ranks ran in this controller step
    Max("clock", recorded=False),  # asp/ssp: the newest clock a rank reached
    Union("moe"),  # per MoE layer: load, drops, aux losses (workers.model.moe.step_figures)
    MaxPerKey("comm_bytes"),  # metrics.comm_bytes: per mesh dimension, the most bytes any rank sent
    PSTraffic("ps"),  # dp_sync ps: push/pull bytes, stalest read
    Mean("eval_loss"),  # eval.every: the held-out loss, the mean over the ranks that score one (the last stage)
    Max("eval_s"),  # eval.every: the slowest rank's evaluation seconds
    LowestRank("data_mix"),  # data.mix: samples each source has supplied so far (every rank reports the same)
    LowestRank("mtp"),  # model.mtp_layers: L_MTP and each depth's loss over the global batch (every rank alike)
    LowestRank("dpo"),  # train.objective: dpo: the global batch's reward figures (every rank reports them)
    LowestRank("global_batch"),  # train.batch_ramp: the step's global batch in sequences (every rank the same)
):
    register(_figure)
