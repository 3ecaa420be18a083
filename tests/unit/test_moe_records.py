"""A rank's MoE figures reach the step record (merged over pipeline stages) and the Prometheus gauges."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.observability.prometheus import MetricsExporter
from orchestrator.observability.run_records import step_record
from workers.loop.summary import StepSummary
from workers.protocol import StepResult, StepTimes

FIGURES = {"tokens_per_expert": [6, 2, 0, 0], "drop_fraction": 0.25, "balance": 3.0, "aux_balance": 0.02}


def _result(rank: int, moe: dict | None) -> StepResult:
    return StepResult(rank=rank, step=1, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=8, applied=True,
                      time_s=StepTimes(step=1.0), peak_memory_bytes=1, current_memory_bytes=1, moe=moe)


def test_step_record_merges_the_layers_each_stage_reports():
    ranks = [_result(0, {"layers.1.feed_forward": FIGURES}),
             _result(1, {"layers.3.feed_forward": {**FIGURES, "balance": 1.5}})]
    record = step_record(StepSummary.of_all(ranks), 1.0, 8, 0.0, 0.0)
    assert record["moe"]["layers.1.feed_forward"] == FIGURES
    assert record["moe"]["layers.3.feed_forward"]["balance"] == 1.5
    assert "moe" not in step_record(StepSummary.of_all([_result(0, None)]), 1.0, 8, 0.0, 0.0)
    assert "moe" not in _result(0, None).to_dict()


def test_exporter_sets_the_moe_gauges():
    exporter = MetricsExporter("j", 0)
    try:
        exporter.figures.observe({"moe": {"layers.1.feed_forward": FIGURES}})
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(generate_latest(exporter.registry).decode())
                   for s in f.samples}
        layer = ("layer", "layers.1.feed_forward")
        assert samples["raymesh_moe_expert_tokens", (("expert", "0"), ("job", "j"), layer)] == 6
        assert samples["raymesh_moe_drop_ratio", (("job", "j"), layer)] == 0.25
        assert samples["raymesh_moe_load_imbalance", (("job", "j"), layer)] == 3.0
        assert samples["raymesh_moe_aux_loss", (("job", "j"), layer, ("loss", "balance"))] == pytest.approx(0.02)
    finally:
        exporter.close()


def test_report_plots_expert_load_over_time(tmp_path):
    from orchestrator.observability.report import write_report

    steps = 6
    summary = {"steps": steps, "losses": [3.0] * steps, "final_loss": 3.0, "tokens_per_s": 100.0,
               "layout": {"dp": 1, "pp": 1, "tp": 1, "world_size": 1, "ranks": []}, "recoveries": [],
               "checkpoints": [], "peak_memory_bytes": {"0": 2**20}, "status": "finished"}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    records = [{"step": s, "time": float(s), "loss": 3.0, "grad_norm": 1.0, "lr": 1e-3, "tokens": 64, "step_s": 1.0,
                "tokens_per_s": 64.0, "phases": {"0": {"compute": 1.0}},
                "memory": {"0": {"peak_bytes": 2**20, "current_bytes": 2**20}},
                "moe": {"layers.1.feed_forward": {**FIGURES, "tokens_per_expert": [8 - s, s, 4, 4]}}}
               for s in range(1, steps + 1)]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = write_report(tmp_path)
    png = next(p for p in result["pngs"] if p.endswith("expert_load.png"))
    assert Path(png).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert 'src="expert_load.png"' in Path(result["html"]).read_text()
