"""What a run leaves in its run directory for people and for ``raymesh report``.

``steps.jsonl`` (one line per step: loss, throughput, phase times and memory
per rank, and bytes sent per mesh dimension with ``metrics.comm_bytes``), ``timeline.jsonl`` (pipeline F/B/W
events, or forward+backward per microbatch, and gradient bucket reductions, when
``metrics.timeline`` is on) and ``summary.json``. A resumed run appends, so
the files cover the whole training history.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from orchestrator.observability.observers import JobObserver, StepReport
from workers.protocol import StepResult
from workers.step.figures import figure_value, fold, record_entries

PHASES = ("data", "compute", "communication", "bubble", "optimizer", "checkpoint")


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file; a line that is not a whole record (a write cut short when a controller
    was killed mid-line, its restarted life appending after it) is skipped and counted on stderr, not fatal."""
    records, torn = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            torn += 1
    if torn:
        print(f"raymesh: warning: skipped {torn} line(s) of {path} that are not whole JSON records (a write cut "
              "short, e.g. by a controller killed mid-line)", file=sys.stderr)
    return records


def kept_steps(records: list[dict]) -> list[dict]:
    """The ``steps.jsonl`` record of each step the model kept, in step order: a recovered run trains its lost
    steps again, and the last record of a step is the one kept."""
    by_step = {r["step"]: r for r in records}
    return [by_step[s] for s in sorted(by_step)]


def summary_fields(records: list[dict]) -> dict:
    """The summary's per-step fields (``RunResult``'s names) from the kept step records, for a summary rebuilt
    without the controller that trained them; ``tokens_per_s`` is then over the steps' own time (the gaps
    between a lost controller's lives are not in the records)."""
    losses = [r["loss"] for r in records]
    trained_s = sum(r["step_s"] for r in records)
    peak: dict[int, int] = {}
    for r in records:
        for rank, memory in r["memory"].items():
            peak[int(rank)] = max(peak.get(int(rank), 0), memory["peak_bytes"])
    return {"losses": losses, "final_loss": losses[-1] if losses else None,
            "tokens_per_s": sum(r["tokens"] for r in records) / trained_s if trained_s else 0.0,
            "grad_norms": [r["grad_norm"] for r in records], "step_time_s": [r["step_s"] for r in records],
            "peak_memory_bytes": peak,
            "eval_losses": [{"step": r["step"], "loss": r["eval_loss"]} for r in records if "eval_loss" in r],
            **({"data_mix": records[-1]["data_mix"]} if records and "data_mix" in records[-1] else {}),
            **({"dpo": records[-1]["dpo"]} if records and "dpo" in records[-1] else {})}


def held_out_loss(results: list[StepResult]) -> float | None:
    """A step's held-out loss (``eval.every``): the mean over the last stage's shares; None when it did not
    evaluate."""
    return figure_value(fold(results), "eval_loss")


def step_record(results: list[StepResult], step_s: float, tokens: int, end_time: float, checkpoint_s: float,
                merged: dict | None = None) -> dict:
    """One ``steps.jsonl`` line from every rank's ``train_step`` result (checkpoint time is the controller's).

    The core entries come from the core fields; every figure of the results' ``extras`` is folded over the ranks
    with its reducer's ``merge`` and recorded by its ``record`` (``workers.step.figures``; ``merged``: that fold,
    when the caller made it already). So ``comm_bytes`` is per mesh dimension the bytes the busiest rank sent,
    ``moe`` per MoE layer its figures (summed over data-parallel ranks by the workers, any rank holding the layer
    reports them), ``dpo`` the global batch's reward figures, and a step that evaluated adds ``eval_loss`` and
    ``eval_s`` (``step_s`` leaves the evaluation out: the controller subtracts it, so throughput is training's)."""
    merged = fold(results) if merged is None else merged
    return {
        "step": results[0].step,
        "time": end_time,
        "loss": statistics.fmean(r.loss for r in results if r.loss is not None),
        "grad_norm": grad_norm(results, merged),
        "lr": results[0].lr,
        "tokens": tokens,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "phases": {str(r.rank): {**{p: getattr(r.time_s, p, 0.0) for p in PHASES}, "checkpoint": checkpoint_s}
                   for r in results},
        "memory": {
            str(r.rank): {"peak_bytes": r.peak_memory_bytes, "current_bytes": r.current_memory_bytes}
            for r in results
        },
        **record_entries(merged),
    }


def grad_norm(results: list[StepResult], merged: dict | None = None) -> float:
    """The step's gradient norm before clipping. All-reduce and bsp: every rank holds the job's one norm, rank
    0's. asp/ssp (``local_steps`` reported): each replica clipped its own local steps, and a rank with none this
    step reports NaN, so the mean of the ranks' finite norms (each the mean of its local steps'); NaN only when no
    replica applied a step (every one overflowed in fp16, or none ran)."""
    if "local_steps" not in (fold(results) if merged is None else merged):
        return results[0].grad_norm
    norms = [r.grad_norm for r in results if math.isfinite(r.grad_norm)]
    return statistics.fmean(norms) if norms else float("nan")


class RunRecords(JobObserver):
    """The per-step files of a run dir, written as an observer of the job: ``steps.jsonl`` and, with
    ``metrics.timeline``, ``timeline.jsonl``."""

    def __init__(self, run_dir: Path, append: bool, timeline: bool):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        mode = "a" if append else "w"
        self._steps = open(run_dir / "steps.jsonl", mode)  # noqa: SIM115 (open for the whole run, closed by close())
        self._timeline = open(run_dir / "timeline.jsonl", mode) if timeline else None  # noqa: SIM115

    def on_step(self, report: StepReport) -> None:
        self._steps.write(json.dumps(report.record) + "\n")
        self._steps.flush()
        if self._timeline is not None:
            for event in figure_value(report.figures, "timeline") or ():
                self._timeline.write(json.dumps(event) + "\n")
            self._timeline.flush()

    @staticmethod
    def write_summary(run_dir: Path, summary: dict) -> Path:
        path = run_dir / "summary.json"
        path.write_text(json.dumps(summary, indent=2))
        return path

    def on_finish(self) -> None:
        self._steps.close()
        if self._timeline is not None:
            self._timeline.close()
