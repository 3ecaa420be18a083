"""A synthetic run dir as the controller writes it, for the report tests (PNGs and the page in a browser)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tests.support.timelines import T0, gpipe_timeline

DP, PP, M, STEPS = 2, 4, 8, 20
MIX_SOURCES = ("/data/stdlib", "s3://bucket/docs")  # a data.mix of 70% and 30%, 8 samples a step


def mixed_samples(step: int) -> dict[str, int]:
    """The samples each of ``MIX_SOURCES`` supplied through ``step``."""
    first = round(0.7 * 8 * step)
    return {MIX_SOURCES[0]: first, MIX_SOURCES[1]: 8 * step - first}


def make_run(run_dir: Path, timeline: bool = True, mix: bool = False) -> Path:
    """A dp=2 × pp=4 GPipe run of 20 steps with one recovery at step 12, as the controller writes it; ``mix``: a
    ``data.mix`` run, whose records and summary count the samples per source."""
    run_dir.mkdir(parents=True, exist_ok=True)
    world = DP * PP
    ranks = [{"rank": r, "coords": {"dp": r // PP, "pp": r % PP, "tp": 0}, "stages": [r % PP], "device": "cpu",
              "node_id": "n0"} for r in range(world)]
    losses = [4.0 * math.exp(-s / 8) + 1.5 for s in range(1, STEPS + 1)]
    summary = {
        "steps": STEPS, "losses": losses, "final_loss": losses[-1], "tokens_per_s": 4300.0,
        "layout": {"dp": DP, "pp": PP, "tp": 1, "zero": 0, "pp_schedule": "gpipe", "virtual_stages": 1,
                   "world_size": world, "microbatches": M, "ranks": ranks},
        "recoveries": [{"kind": "actor_died", "rank": 5, "at_step": 12, "mttr_s": 7.5, "lost_steps": 2}],
        "checkpoints": [str(run_dir / "checkpoints" / "step-10"), str(run_dir / "checkpoints" / "step-20")],
        "peak_memory_bytes": {str(r): (300 + 40 * (PP - r % PP)) * 2**20 for r in range(world)},
        "status": "finished",
        **({"data_mix": mixed_samples(STEPS)} if mix else {}),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    records = []
    for s in range(1, STEPS + 1):
        slow = 2.0 if s == 12 else 1.0
        phases = {str(r): {"data": 0.01, "compute": 0.5 * slow, "communication": 0.1 + 0.01 * (r % PP),
                           "bubble": 0.2, "optimizer": 0.05, "checkpoint": 0.3 if s in (10, 20) else 0.0}
                  for r in range(world)}
        step_s = 0.9 * slow + (0.3 if s in (10, 20) else 0.0)
        records.append({"step": s, "time": T0 + s, "loss": losses[s - 1], "grad_norm": 1.0, "lr": 1e-3,
                        "tokens": 4096, "step_s": step_s, "tokens_per_s": 4096 / step_s, "phases": phases,
                        "memory": {str(r): {"peak_bytes": 350 * 2**20, "current_bytes": (200 + s + 10 * r) * 2**20}
                                   for r in range(world)}, **({"data_mix": mixed_samples(s)} if mix else {})})
    records.insert(11, {**records[11], "loss": 9.9})  # a replayed step 12 before the recovery: last one wins
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if timeline:
        events = [e for s in (STEPS - 1, STEPS) for e in gpipe_timeline(PP, M, step=s, dp=DP, t0=T0 + 10 * s)]
        (run_dir / "timeline.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir
