"""The summary of a run: what ``--summary-json`` writes and ``TrainingJob.run`` returns."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class RunResult:
    steps: int
    losses: list[float]
    final_loss: float | None
    tokens_per_s: float
    layout: dict
    recoveries: list[dict] = field(default_factory=list)
    resizes: list[dict] = field(default_factory=list)  # dp changes: reason shrink/grow/request, at_step, dp_from/to
    # parameter_server.resize: at_step, shards_from/to, chunks, primaries_moved, chunks_moved, bytes_moved, seconds
    ps_resizes: list[dict] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    peak_memory_bytes: dict[int, int] = field(default_factory=dict)
    memory: dict[int, dict] = field(default_factory=dict)  # measured vs predicted bytes per rank (memory.measure)
    grad_norms: list[float] = field(default_factory=list)
    startup_s: float = 0.0
    step_time_s: list[float] = field(default_factory=list)
    resumed_from: str | None = None
    status: str = "finished"  # "stopped" when a stop was requested; "failed" when the last save failed
    # the run's last save failed (status "failed"): {step, reason, last_on_disk, last_checkpoint, steps_not_kept}
    checkpoint_failure: dict | None = None
    goodput: float = 0.0  # productive step time (steps kept, not rolled back) over training wall time
    stragglers: list[dict] = field(default_factory=list)  # {rank, since_step, until_step, max_ratio}
    corrupt_checkpoints: list[dict] = field(default_factory=list)  # skipped on load: {step, path, problem, found_by}
    run_dir: str = ""  # where summary.json, the step records and (by default) the checkpoints are
    eval_losses: list[dict] = field(default_factory=list)  # eval.every: {step, loss} of the held-out set
    best_checkpoint: dict | None = None  # {step, path, eval_loss}: the kept checkpoint with the lowest held-out loss
    data_mix: dict | None = None  # data.mix: the samples each source (by path) supplied, through the last step
    dpo: dict | None = None  # train.objective: dpo: the last step's reward accuracy, mean rewards and margin

    def to_dict(self) -> dict:
        d = asdict(self)
        d["peak_memory_bytes"] = {str(k): v for k, v in self.peak_memory_bytes.items()}
        d["memory"] = {str(k): v for k, v in self.memory.items()}
        return d

    def write_json(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))
