"""``write_report`` on a synthetic run dir: every chart is a real PNG, the page shows them, the bubble is measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.observability.report import write_report
from tests.support.report_runs import MIX_SOURCES, STEPS, make_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
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
                                "ordered": pytest.approx(3 / 11, rel=1e-9), "theoretical": pytest.approx(3 / 11),
                                "schedule": "gpipe"}
    page = Path(result["html"]).read_text()
    assert "27.3%" in page and f"bubble (step {STEPS}&#x27;s order at ideal costs" in page
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
    assert result["bubble"] == {"step": None, "measured": None, "ordered": None,
                                "theoretical": pytest.approx(3 / 11), "schedule": "gpipe"}


def test_report_needs_a_summary(tmp_path):
    with pytest.raises(FileNotFoundError, match="--summary-json") as err:
        write_report(tmp_path)
    assert str(tmp_path) in str(err.value) and "run_dir" in str(err.value)


def test_report_from_a_summary_alone(tmp_path):
    run = make_run(tmp_path / "run", timeline=False)
    (run / "steps.jsonl").unlink()
    assert_pngs(write_report(run), {"loss.png", "memory.png"})


def test_a_torn_line_in_the_records_is_skipped_and_said(tmp_path, capsys):
    """A controller killed mid-line, restarted, appends after the torn line: the report still draws every whole
    record and says how many lines it skipped."""
    run = make_run(tmp_path / "run", timeline=False)
    lines = (run / "steps.jsonl").read_text().splitlines()
    torn = [*lines[:5], lines[5][:40], *lines[6:]]
    (run / "steps.jsonl").write_text("\n".join(torn) + "\n")
    assert_pngs(write_report(run), {"loss.png", "throughput.png", "step_breakdown.png", "memory.png"})
    assert "skipped 1 line(s) of" in capsys.readouterr().err


def test_the_cli_prints_a_step_not_recorded_as_one_line(tmp_path, capsys):
    from orchestrator.cli import main

    assert main(["report", str(make_run(tmp_path / "run")), "--step", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raymesh: error: step 3 is not in") and "Traceback" not in err


def test_recovery_marks_name_the_shard_or_only_the_kind_where_no_rank_died():
    """A shard restart and a NaN rollback record rank -1: the chart said "rank -1" for both."""
    from orchestrator.observability.report import _figure, _mark_recoveries

    ax = _figure().add_subplot()
    _mark_recoveries(ax, [{"kind": "kill_ps_shard", "rank": -1, "shard": 1, "at_step": 4},
                          {"kind": "nan_loss", "rank": -1, "at_step": 6}, {"kind": "rank", "rank": 2, "at_step": 6}])
    assert sorted(t.get_text() for t in ax.texts) == ["kill_ps_shard (shard 1)", "nan_loss, rank (rank 2)"]


def test_a_mixture_run_shows_the_samples_per_source_in_the_table_chart_and_cli(tmp_path, capsys):
    """`data.mix`: the page's table and the CLI name each source's samples and share through the last step, and a
    chart draws the shares per step; from the summary alone the table still has them."""
    from orchestrator.cli import main

    run = make_run(tmp_path / "run", timeline=False, mix=True)
    result = write_report(run)
    assert_pngs(result, {"loss.png", "throughput.png", "step_breakdown.png", "memory.png", "data_mix.png"})
    shown = f"{MIX_SOURCES[0]} 112 (70.0%), {MIX_SOURCES[1]} 48 (30.0%)"
    assert result["data_mix"] == (STEPS, {MIX_SOURCES[0]: 112, MIX_SOURCES[1]: 48})
    assert f"<th>data mix (samples per source through step {STEPS})</th><td>{shown}</td>" in Path(
        result["html"]).read_text()
    assert main(["report", str(run)]) == 0
    assert f"data mix through step {STEPS}: {shown}" in capsys.readouterr().out
    (run / "steps.jsonl").unlink()
    alone = write_report(run)
    assert_pngs(alone, {"loss.png", "memory.png"})
    assert shown in Path(alone["html"]).read_text()


def test_a_run_without_a_mixture_shows_none(tmp_path):
    result = write_report(make_run(tmp_path / "run", timeline=False))
    assert result["data_mix"] is None and "data mix" not in Path(result["html"]).read_text()
