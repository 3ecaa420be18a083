"""The controller's Prometheus exporter fed fake layouts, step records and recoveries, read back as Prometheus
parses a scrape (no Ray: the exporter serves on loopback)."""

from __future__ import annotations

import json

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator import JobSpec
from orchestrator.observability.observers import MetricsObserver, StepReport
from orchestrator.observability.prometheus import RECOVERY_KINDS, MetricsExporter


def layout(dp: int) -> dict:
    """A layout dict as ``Layout.to_dict`` gives it: dp ranks, one stage each."""
    ranks = [{"rank": r, "stages": [0], "coords": {"dp": r, "pp": 0, "tp": 0}} for r in range(dp)]
    return {"dp": dp, "pp": 1, "tp": 1, "ranks": ranks}


def samples(exporter: MetricsExporter) -> dict[tuple[str, tuple], float]:
    """Every sample of a scrape, by (name, sorted labels)."""
    text = generate_latest(exporter.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def recoveries(exporter: MetricsExporter) -> dict[str, float]:
    return {dict(labels)["kind"]: value for (name, labels), value in samples(exporter).items()
            if name == "raymesh_recoveries_total"}


@pytest.fixture
def observer(tmp_path):
    spec = JobSpec.from_dict({"name": "j", "data": {"path": "data/x"}, "run_dir": str(tmp_path / "run"),
                              "metrics": {"port": 0}})
    observer = MetricsObserver(spec, tmp_path / "run", layout(2))
    yield observer
    observer.on_finish()


def test_every_recovery_kind_starts_at_zero_and_a_shard_restart_counts_as_ps_shard(observer):
    exporter = observer.exporter
    assert recoveries(exporter) == dict.fromkeys(RECOVERY_KINDS, 0.0)
    observer.on_ps_shard_recovered({"kind": "kill_ps_shard", "rank": -1, "shard": 1, "at_step": 4,
                                    "lost_steps": 0, "source": "replica", "mttr_s": 0.5})
    assert recoveries(exporter) == {**dict.fromkeys(RECOVERY_KINDS, 0.0), "ps_shard": 1.0}
    scraped = samples(exporter)
    assert scraped["raymesh_restarts_total", (("job", "j"),)] == 0  # no rank actor restarted
    assert scraped["raymesh_lost_steps_total", (("job", "j"),)] == 0
    assert scraped["raymesh_mttr_seconds", (("job", "j"),)] == 0.5  # the shard's restart, as summary.json has it


def record(step: int, ranks: int) -> dict:
    """A ``steps.jsonl`` record of ``ranks`` ranks (``run_records.step_record``'s keys)."""
    per_rank = {str(r): {"compute": 0.1, "bubble": 0.0} for r in range(ranks)}
    memory = {str(r): {"peak_bytes": 10, "current_bytes": 5} for r in range(ranks)}
    return {"step": step, "tokens": 64, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "step_s": 0.1,
            "tokens_per_s": 640.0, "phases": per_rank, "memory": memory}


def resized(dp: int):
    from orchestrator.records import ResizeRecord

    return ResizeRecord("shrink", 3, 2, dp, 4, "memory", 0.5)


def test_a_resize_keeps_the_last_mttr(observer):
    observer.on_mttr(7.5)
    observer.on_resized(resized(1), layout(1))
    assert samples(observer.exporter)["raymesh_mttr_seconds", (("job", "j"),)] == 7.5


def per_rank(exporter: MetricsExporter, name: str) -> set[str]:
    return {dict(labels)["rank"] for (metric, labels), _ in samples(exporter).items() if metric == name}


def test_a_rank_a_resize_removed_loses_its_series_and_a_joined_one_has_a_heartbeat_at_once(observer):
    """dp 2 -> 1: rank 1's heartbeat age would otherwise grow for ever (a hang to any alert) and its straggler
    flag stay; before its first step a rank already has a heartbeat, so a hang there shows."""
    exporter = observer.exporter
    assert per_rank(exporter, "raymesh_heartbeat_age_seconds") == {"0", "1"}  # formed, no step yet
    observer.on_step(StepReport(record(1, 2), 0.1, 0.0, 0.9, {0: 1.0, 1: 3.0}, frozenset({1})))
    observer.on_resized(resized(1), layout(1))
    for name in ("raymesh_heartbeat_age_seconds", "raymesh_straggler", "raymesh_step_slowdown_ratio",
                 "raymesh_memory_peak_bytes", "raymesh_memory_current_bytes", "raymesh_step_phase_seconds"):
        assert per_rank(exporter, name) == {"0"}, name
    observer.on_resized(resized(2), layout(2))
    assert per_rank(exporter, "raymesh_heartbeat_age_seconds") == {"0", "1"}


def test_the_target_file_is_replaced_whole_when_written_and_when_emptied(tmp_path):
    """Prometheus re-reads the file as it changes: each write is a new file renamed over the old one (a new inode),
    never the old one truncated and rewritten, and it leaves no temporary file behind."""
    target = tmp_path / "sd" / "j.json"
    exporter = MetricsExporter("j", 0)
    try:
        exporter.write_file_sd(target)
        first = target.stat().st_ino
        assert json.loads(target.read_text())[0]["labels"] == {"raymesh_job": "j"}
        with target.open() as held:  # what Prometheus holds open while it reads
            exporter.close()
            assert json.loads(held.read())[0]["targets"] == [exporter.address()]  # the old file, still whole
        assert target.stat().st_ino != first and json.loads(target.read_text()) == []
        assert [p.name for p in target.parent.iterdir()] == ["j.json"]
    finally:
        exporter.close()  # again after the test's own close: a no-op but the empty file
