"""What a run leaves in its run directory for people and for ``raymesh report``.

``steps.jsonl`` (one line per step: loss, throughput, phase times and memory
per rank (or, on the steps of a large job without per-rank detail, their reduction over the ranks), and bytes
sent per mesh dimension with ``metrics.comm_bytes``), ``timeline.jsonl`` (pipeline F/B/W
events, or forward+backward per microbatch, and gradient bucket reductions, when
``metrics.timeline`` is on) and ``summary.json``. A resumed run appends, so
the files cover the whole training history: a controller Ray restarted after its process was lost (a hosted
controller's restarted life) appends too, and ``controller.jsonl`` (one line per controller life: when it began
training, from which step, whether Ray restarted it) tells where each life's records start, so that loss is
recovered like any other (``begin_life``: a ``controller`` recovery with its lost steps and MTTR).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.observability.observers import JobObserver, StepReport
from orchestrator.records import RecoveryRecord
from orchestrator.recovery.phases import RecoveryPhases
from orchestrator.run_result import RunResult
from workers.contract.figures import figure_value, record_entries
from workers.loop.summary import StepSummary

if TYPE_CHECKING:
    from orchestrator.observability.step_accounting import StepAccounting

PHASES = ("data", "compute", "communication", "bubble", "optimizer", "checkpoint")
LIVES = "controller.jsonl"


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
        for rank, memory in rank_peaks(r).items():
            peak[rank] = max(peak.get(rank, 0), memory)
    return {"losses": losses, "final_loss": losses[-1] if losses else None,
            "tokens_per_s": sum(r["tokens"] for r in records) / trained_s if trained_s else 0.0,
            "grad_norms": [r["grad_norm"] for r in records], "step_time_s": [r["step_s"] for r in records],
            "peak_memory_bytes": peak,
            "eval_losses": [{"step": r["step"], "loss": r["eval_loss"]} for r in records if "eval_loss" in r],
            **({"data_mix": records[-1]["data_mix"]} if records and "data_mix" in records[-1] else {}),
            **({"dpo": records[-1]["dpo"]} if records and "dpo" in records[-1] else {})}


def rank_peaks(record: dict) -> dict[int, int]:
    """Each rank's peak memory a step record names: every rank's on a step with per-rank detail, else the
    highest one's."""
    if "memory" in record:
        return {int(rank): memory["peak_bytes"] for rank, memory in record["memory"].items()}
    peak, rank = record["ranks"]["peak_bytes"]
    return {rank: peak}


def held_out_loss(summary: StepSummary) -> float | None:
    """A step's held-out loss (``eval.every``): the mean over the last stage's shares; None when it did not
    evaluate."""
    return figure_value(summary.extras, "eval_loss")


def step_record(summary: StepSummary, step_s: float, tokens: int, end_time: float, checkpoint_s: float) -> dict:
    """One ``steps.jsonl`` line from the step's summary, reduced over the ranks in-band (``workers.loop.summary``;
    checkpoint time is what the ranks' saves held them since the last step).

    The core entries: the mean loss of the ranks that report one (the last stage), rank 0's grad norm and lr (under
    asp/ssp the mean of the ranks' finite norms). On a step with per-rank detail (``Window.detail_every``: every
    step up to 256 ranks), each rank's phase times and memory (``phases``, ``memory``); on the others their
    reduction (``ranks``: how many, phase means and maxima, the two slowest steps as [seconds, rank], the highest
    peak memory as [bytes, rank]). Every figure of the ranks' ``extras`` is recorded by its reducer's ``record``
    (``workers.contract.figures``): ``comm_bytes`` per mesh dimension the bytes the busiest rank sent, ``moe`` per MoE
    layer its figures, ``dpo`` the global batch's reward figures, and a step that evaluated ``eval_loss`` and
    ``eval_s`` (``step_s`` leaves the evaluation out: the controller subtracts it, so throughput is training's)."""
    record = {"step": summary.step, "time": end_time, "loss": summary.mean_loss, "grad_norm": summary.grad_norm,
              "lr": summary.lr, "tokens": tokens, "step_s": step_s, "tokens_per_s": tokens / step_s}
    if summary.detail is not None:
        ranks = sorted(summary.detail.items())
        record["phases"] = {str(r): _phases(d.phases, checkpoint_s) for r, d in ranks}
        record["memory"] = {str(r): {"peak_bytes": d.peak_bytes, "current_bytes": d.current_bytes} for r, d in ranks}
    else:
        record["ranks"] = {"count": summary.ranks, "phases_mean": _phases(summary.phase_means(), checkpoint_s),
                           "phases_max": _phases(summary.phase_maxima(), checkpoint_s),
                           "slowest": [list(s) for s in summary.slowest], "peak_bytes": list(summary.peak),
                           "current_bytes_max": summary.current}
    return {**record, **record_entries(summary.extras)}


def _phases(times: dict[str, float], checkpoint_s: float) -> dict[str, float]:
    """A rank's phase times as the records name them, with the controller's checkpoint time last."""
    return {**{p: times.get(p, 0.0) for p in PHASES if p != "checkpoint"}, "checkpoint": checkpoint_s}


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


@dataclass(frozen=True)
class ControllerLoss:
    """A controller process lost and restarted by Ray, as the run dir's records tell it."""

    at_step: int  # the first step the restarted life trains
    lost_steps: int  # steps the lost life trained past the checkpoint resumed from: trained again
    since: float  # unix time of the lost life's last sign: its last step record, else its start
    mttr_s: float | None = None  # from ``since`` to the restarted life's first step record, once there is one

    def record(self, dp: int):
        """Its ``RecoveryRecord`` (kind ``controller``, no rank; state from disk, or step 0 without a checkpoint)."""
        source = "disk" if self.at_step > 1 else "initial"
        record = RecoveryRecord("controller", -1, self.at_step, self.lost_steps, source, {}, dp, dp)
        return record if self.mttr_s is None else record.completed(self.mttr_s, {})


def begin_life(run_dir: Path, step: int, restarted: bool, append: bool) -> ControllerLoss | None:
    """Record in ``controller.jsonl`` that a controller life begins training at ``step`` (a fresh run starts
    the file over, as it does ``steps.jsonl``); when Ray ``restarted`` this controller, the loss of the life
    before it, read from the records before this life adds any."""
    run_dir.mkdir(parents=True, exist_ok=True)
    life = {"started": time.time(), "step": step, "restarted": restarted, "host": socket.gethostname(),
            "pid": os.getpid()}
    lives = _lives_of(run_dir) if append else []
    loss = _loss(lives[-1] if lives else None, life, _steps_of(run_dir)) if restarted else None
    with open(run_dir / LIVES, "a" if append else "w") as f:
        f.write(json.dumps(life) + "\n")
    return loss


def controller_losses(run_dir: Path) -> list[ControllerLoss]:
    """Every controller loss Ray restarted the controller after, with its MTTR where the restarted life trained
    a step: what the summary of a run whose controller was lost for good reports (``lost_run_summary``)."""
    lives = _lives_of(run_dir)
    records = _steps_of(run_dir)
    losses = []
    for before, life in zip([None, *lives], lives, strict=False):
        if life.get("restarted"):
            loss = _loss(before, life, records)
            first = next((r for r in records if r["time"] >= life["started"]), None)
            losses.append(ControllerLoss(loss.at_step, loss.lost_steps, loss.since,
                                         first["time"] - loss.since if first else None))
    return losses


def account_controller_loss(acct: StepAccounting, loss: ControllerLoss, dp: int) -> None:
    """Recover from the controller's own loss as from any other: its record waits for the first step (the MTTR
    runs from the lost life's last sign of life), and the gap counts as training time lost in the goodput."""
    phases = RecoveryPhases(time.perf_counter() - max(0.0, time.time() - loss.since))
    phases.lap("restart")  # Ray's restart of the process, the new life's start-up and its resume
    record = loss.record(dp)
    acct.observers.on_recovered(record, loss.at_step - 1, 0, phases.seconds)
    acct.rolled_back((record, phases), 0)
    acct.t_train = min(acct.t_train, phases.start)


def lost_run_summary(run_dir: Path, checkpoints: list[str], dp: int, reason: str, shown_dir: str) -> dict | None:
    """The summary of a run whose controller Ray gave up restarting, from what its run dir holds: None when the
    run had ended (``_ended``: a follower collected its outcome and let the actor go), else its kept step
    records, the controller losses Ray recovered from, the ``checkpoints``, status ``failed`` and ``error``
    saying why (``reason``)."""
    records = kept_steps(_steps_of(run_dir))
    if _ended(run_dir, records[-1]["step"] if records else 0):
        return None
    result = RunResult(steps=records[-1]["step"] if records else 0, layout={}, checkpoints=checkpoints,
                       status="failed", run_dir=shown_dir, **summary_fields(records),
                       recoveries=[loss.record(dp).to_dict() for loss in controller_losses(run_dir)])
    return {**result.to_dict(), "error": reason}


def _ended(run_dir: Path, last_step: int) -> bool:
    """Whether ``summary.json`` is the run's last word: written after its last controller life began (a copy
    pulled from a bucket is new here, so also) covering the newest step recorded."""
    written = run_dir / "summary.json"
    if not written.is_file():
        return False
    lives = _lives_of(run_dir)
    newer = not lives or written.stat().st_mtime >= lives[-1]["started"]
    return newer and json.loads(written.read_text()).get("steps", -1) >= last_step


def _steps_of(run_dir: Path) -> list[dict]:
    path = run_dir / "steps.jsonl"
    return read_jsonl(path) if path.is_file() else []


def _lives_of(run_dir: Path) -> list[dict]:
    path = run_dir / LIVES
    return read_jsonl(path) if path.is_file() else []


def _loss(before: dict | None, life: dict, records: list[dict]) -> ControllerLoss:
    """The loss that ended the life ``before`` (``controller.jsonl`` lines), which ``life`` resumed: the lost
    life's records are those written between the two lives' starts. Without a line for the lost life (it was
    lost before it began training) its last sign is taken as the restarted life's start."""
    started = before["started"] if before else life["started"]
    own = [r for r in records if started <= r["time"] < life["started"]]
    last = own[-1] if own else None
    since = last["time"] if last else started
    return ControllerLoss(life["step"] + 1, max(0, last["step"] - life["step"]) if last else 0, since)
