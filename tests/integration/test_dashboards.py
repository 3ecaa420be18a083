"""The Grafana dashboard and the Prometheus config, checked against the exporter's real metric names (no Ray)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from orchestrator.observability.prometheus import MetricsExporter
from tests.support.dashboards import DASHBOARDS, PROMETHEUS_YML, PROVISIONING, load_dashboard, panel_exprs, panels

METRIC = re.compile(r"\braymesh_[a-zA-Z0-9_]*")
SELECTOR = re.compile(r"\b(raymesh_[a-zA-Z0-9_]*)(\{[^}]*\})?")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "summary": ("", "_sum", "_count", "_created")}


def exported() -> dict[str, tuple[str, ...] | None]:
    """Every series name the exporter can expose -> the label names of its metric (None: not knowable)."""
    exporter = MetricsExporter("t", 0)
    try:
        labels: dict[str, tuple[str, ...] | None] = {}
        for collector in vars(exporter).values():
            if isinstance(collector, MetricWrapperBase):
                labels[collector._name] = tuple(collector._labelnames)
        names: dict[str, tuple[str, ...] | None] = {}
        for family in exporter.registry.collect():
            for suffix in SUFFIXES[family.type]:
                names[family.name + suffix] = labels.get(family.name)
        return names
    finally:
        exporter.close()


@pytest.fixture(scope="module")
def metric_names() -> dict[str, tuple[str, ...] | None]:
    return exported()


def test_dashboard_is_importable_json():
    d = load_dashboard()
    assert d["schemaVersion"] >= 36 and d["title"] and d["uid"]
    assert d.get("id") is None, "an exported dashboard must not carry a database id"
    ids = [p["id"] for p in d["panels"]] + [p["id"] for r in d["panels"] for p in r.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert titles == ["Progress", "Time breakdown", "Memory", "Pipeline", "Fault tolerance", "Parameter server",
                      "Mixture of experts", "Preference training (DPO)"]
    for p in d["panels"]:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]


def test_template_variables():
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    job = variables["job"]
    assert job["type"] == "query" and "label_values(raymesh_steps_total, job)" in json.dumps(job["query"])
    rank = variables["rank"]
    assert rank["type"] == "query" and rank["multi"] and rank["includeAll"] and rank["allValue"] == ".*"
    assert 'label_values(raymesh_memory_peak_bytes{job="$job"}, rank)' in json.dumps(rank["query"]).replace('\\"', '"')
    for p in panels(load_dashboard()):
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]


def test_every_panel_has_a_target_and_a_unit():
    for p in panels(load_dashboard()):
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert p["fieldConfig"]["defaults"].get("unit"), f"panel {p['title']!r} sets no unit"


def test_exprs_use_only_exported_metrics_filtered_by_job_and_rank(metric_names):
    for where, expr in panel_exprs(load_dashboard()):
        used = METRIC.findall(expr)
        assert used, f"{where}: {expr} uses no raymesh metric"
        for name, braces in SELECTOR.findall(expr):
            assert name in metric_names, f"{where}: {name} is not exported by orchestrator/observability/prometheus.py"
            assert braces and 'job="$job"' in braces, f"{where}: {name} is not filtered by job=\"$job\""
            labels = metric_names[name]
            if labels is not None and "rank" in labels:
                assert 'rank=~"$rank"' in braces, f"{where}: per-rank {name} is not filtered by rank=~\"$rank\""
            if labels is not None and "rank" not in labels:
                assert "rank" not in braces, f"{where}: {name} has no rank label"


def test_every_exported_metric_has_a_panel(metric_names):
    used = {name for _, expr in panel_exprs(load_dashboard()) for name in METRIC.findall(expr)}
    bases = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    families = {re.sub(r"_(total|created|bucket|sum|count)$", "", n) for n in metric_names}
    missing = {f for f in families if f not in bases and f + "_total" not in used}
    assert not missing, f"exported but on no dashboard panel: {sorted(missing)}"


def test_units_match_metric_base_units():
    for p in panels(load_dashboard()):
        unit = p["fieldConfig"]["defaults"]["unit"]
        exprs = [t["expr"] for t in p["targets"]]
        names = {n for e in exprs for n in METRIC.findall(e)}
        if all(n.endswith("_ratio") for n in names):
            assert unit == "percentunit", p["title"]
        elif all(n.endswith("_bytes") for n in names):
            assert unit == "bytes", p["title"]
        elif all(n.endswith("_bytes_total") for n in names) and all(e.startswith("rate(") for e in exprs):
            assert unit in ("Bps", "binBps"), p["title"]
        elif all(re.search(r"_seconds(_bucket|_sum|_count)?$", n) for n in names):
            assert unit == "s", p["title"]


def test_metrics_table_in_the_monitoring_guide_lists_every_metric(metric_names):
    guide_path = DASHBOARDS.parent / "docs" / "guides" / "monitoring.md"
    guide = guide_path.read_text()
    for name in metric_names:
        if name.endswith(("_created", "_bucket", "_sum", "_count")):
            continue
        assert f"| `{name}` |" in guide, f"{guide_path.relative_to(DASHBOARDS.parent)} has no row for {name}"


def test_prometheus_config_uses_file_sd():
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "raymesh"]
    assert job["honor_labels"] is True, "the exporter's `job` label must survive the scrape"
    files = [f for sd in job["file_sd_configs"] for f in sd["files"]]
    assert files and all(f.endswith(".json") for f in files)
    # Prometheus refuses a `*` anywhere but in the last path element
    assert all("*" not in f.rsplit("/", 1)[0] for f in files), files


def test_prometheus_config_passes_promtool():  # promtool ships in Debian's prometheus, which .ci/run installs
    out = subprocess.run(["promtool", "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def docker_mounts() -> dict[str, Path]:
    """Container path -> repository folder, from the `docker run -v "$PWD/...:..."` lines of dashboards/README.md
    (the way a Grafana install is given the provisioning and dashboard folders unchanged)."""
    readme = (DASHBOARDS / "README.md").read_text()
    return {target: DASHBOARDS.parent / source for source, target in re.findall(r'-v "\$PWD/([^:"]+):([^"]+)"', readme)}


def test_grafana_provisioning_adds_the_prometheus_and_loads_this_folders_dashboards():
    mounts = docker_mounts()
    assert mounts["/etc/grafana/provisioning"] == PROVISIONING  # Grafana's default provisioning path
    (source,) = yaml.safe_load((PROVISIONING / "datasources" / "raymesh-prometheus.yaml").read_text())["datasources"]
    assert source["type"] == load_dashboard()["templating"]["list"][0]["query"] == "prometheus"
    assert source["url"] == "http://127.0.0.1:9090" and source["isDefault"] and source["access"] == "proxy"
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "raymesh.yaml").read_text())
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    folder = mounts[provider["options"]["path"]]  # the provider's path is where this folder is mounted
    found = sorted(folder.glob("**/*.json"))
    assert found == [DASHBOARDS / "grafana" / "raymesh.json"]
    assert all(json.loads(f.read_text())["uid"] for f in found)
