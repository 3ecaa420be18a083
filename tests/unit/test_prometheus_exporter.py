"""The controller's Prometheus exporter fed fake layouts, step records and recoveries, read back as Prometheus
parses a scrape (no Ray: the exporter serves on loopback)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator import JobSpec
from orchestrator.observability.observers import MetricsObserver
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
