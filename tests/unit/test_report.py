"""``write_report`` on a synthetic run dir: every chart is a real PNG, the page shows them, the bubble is measured."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from orchestrator.observability.report import write_report
from tests.support.timelines import T0, gpipe_timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DP, PP, M, STEPS = 2, 4, 8, 20


def make_run(run_dir: Path, timeline: bool = True) -> Path:
    """A dp=2 × pp=4 GPipe run of 20 steps with one recovery at step 12, as the controller writes it."""
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
                                   for r in range(world)}})
    records.insert(11, {**records[11], "loss": 9.9})  # a replayed step 12 before the recovery: last one wins
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if timeline:
        events = [e for s in (STEPS - 1, STEPS) for e in gpipe_timeline(PP, M, step=s, dp=DP, t0=T0 + 10 * s)]
        (run_dir / "timeline.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


def assert_pngs(result: dict, names: set[str]) -> None:
    assert {Path(p).name for p in result["pngs"]} == names
    for p in result["pngs"]:
        data = Path(p).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, p
    page = Path(result["html"]).read_text()
    for name in names:
        assert f'src="{name}"' in page


def test_report_writes_every_chart_and_the_bubble(tmp_path):
    run = make_run(tmp_path / "run")
    result = write_report(run)
    assert Path(result["html"]) == run / "report" / "index.html"
    assert_pngs(result, {"loss.png", "throughput.png", "step_breakdown.png", "memory.png", "pipeline_timeline.png"})
    assert result["bubble"] == {"step": STEPS, "measured": pytest.approx(3 / 11, rel=1e-9),
                                "theoretical": pytest.approx(3 / 11), "schedule": "gpipe"}
    page = Path(result["html"]).read_text()
    assert "27.3%" in page
    assert "1 (lost steps 2, mean MTTR 7.5 s)" in page


def test_report_step_and_out_dir(tmp_path):
    run = make_run(tmp_path / "run")
    result = write_report(run, tmp_path / "elsewhere", step=STEPS - 1)
    assert Path(result["html"]).parent == tmp_path / "elsewhere"
    assert result["bubble"]["step"] == STEPS - 1
    with pytest.raises(ValueError, match=r"recorded steps: \[19, 20\]"):
        write_report(run, step=3)


def test_report_without_timeline_skips_the_gantt(tmp_path):
    result = write_report(make_run(tmp_path / "run", timeline=False))
    assert_pngs(result, {"loss.png", "throughput.png", "step_breakdown.png", "memory.png"})
    assert result["bubble"] == {"step": None, "measured": None, "theoretical": pytest.approx(3 / 11),
                                "schedule": "gpipe"}


def test_report_needs_a_summary(tmp_path):
    with pytest.raises(FileNotFoundError, match="--summary-json") as err:
        write_report(tmp_path)
    assert str(tmp_path) in str(err.value) and "run_dir" in str(err.value)


def test_report_from_a_summary_alone(tmp_path):
    run = make_run(tmp_path / "run", timeline=False)
    (run / "steps.jsonl").unlink()
    assert_pngs(write_report(run), {"loss.png", "memory.png"})
