"""The checked-in Grafana dashboard and Prometheus config, read the way Grafana and Prometheus read them.

Shared by the static dashboard checks and the live Prometheus test, which query the same panel expressions.
"""

from __future__ import annotations

import json
from pathlib import Path

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
DASHBOARD = DASHBOARDS / "grafana" / "raymesh.json"
PROMETHEUS_YML = DASHBOARDS / "prometheus" / "prometheus.yml"
PROVISIONING = DASHBOARDS / "grafana" / "provisioning"


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every non-row panel, including those nested in collapsed rows."""
    out = []
    for p in dashboard["panels"]:
        if p["type"] == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def panel_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title + refId, expr) for every target of every panel."""
    return [(f"{p['title']} [{t['refId']}]", t["expr"]) for p in panels(dashboard) for t in p["targets"]]


def concrete(expr: str, job: str, rank: str = ".*") -> str:
    """The expr as Grafana sends it for one job and all ranks."""
    return (expr.replace("$job", job).replace("${job}", job).replace("$rank", rank).replace("${rank}", rank)
            .replace("$__rate_interval", "10s"))
