"""A real Prometheus scrapes a real job through file_sd, and every dashboard panel's query returns data.

Prometheus is the Debian package (``apt-get install prometheus``; ``.ci/run``
installs it). The test starts its own server on a free port with the shipped
``dashboards/prometheus/prometheus.yml`` narrowed to this job's target file and
a 1 s scrape interval. The job is the real 4-rank job with the real exporter,
only held at two steps until Prometheus has scraped it (see ``PacedExporter``);
the panel queries are evaluated at the time of the last scrape taken while the
job still ran.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import ClassVar

import pytest
import yaml

from orchestrator import TrainingJob
from orchestrator.observability import observers
from orchestrator.observability.prometheus import MetricsExporter
from tests.support.dashboards import PROMETHEUS_YML, concrete, load_dashboard, panel_exprs
from tests.support.jobs import tiny_spec, wait_for

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"  # .ci/run installs Debian's package


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path):
        self.url, self.proc, self.log = url, proc, log

    def get(self, path: str, **params) -> dict:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        return self.get("/api/v1/query", **params)["result"]

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])


@pytest.fixture
def prometheus(tmp_path: Path):
    """A Prometheus server scraping, every second, the targets in ``tmp_path/<target file>`` (set by the test)."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    (scrape,) = config["scrape_configs"]
    scrape.update(scrape_interval="1s", scrape_timeout="1s")

    def start(target_file: Path) -> Prometheus:
        scrape["file_sd_configs"] = [{"files": [str(target_file)], "refresh_interval": "1s"}]
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        port = _free_port()
        log = tmp_path / "prometheus.log"
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log.open("w"), stderr=subprocess.STDOUT,
        )
        started.append(proc)
        prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)

        def ready() -> bool:
            assert proc.poll() is None, f"prometheus exited {proc.returncode}:\n{prom.log_tail()}"
            try:
                with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as r:
                    return r.status == 200
            except (urllib.error.URLError, ConnectionError):
                return False

        wait_for(ready, 30, "prometheus /-/ready")
        return prom

    started: list[subprocess.Popen] = []
    yield start
    for proc in started:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


STEPS = 40
HOLD_AT = 6  # the first hold: Prometheus must have scraped the target with raymesh_steps_total > 5


class PacedExporter(MetricsExporter):
    """The real exporter, holding the job at step ``HOLD_AT`` and at its last step until Prometheus has scraped it.

    The tiny job trains its 40 steps in ~3 s, while Prometheus (2.42) passes a new file_sd target on to its
    scrape loop only after up to ~10 s (its discovery and scrape managers each batch updates every 5 s), so
    without the holds the job could end before its first scrape.
    """

    gates: ClassVar[dict[int, threading.Event]] = {}

    def observe_step(self, record: dict, *args, **kwargs) -> None:
        super().observe_step(record, *args, **kwargs)
        gate = self.gates.get(record["step"])
        if gate is not None:
            gate.wait(timeout=45)


def test_every_dashboard_panel_has_data_from_a_real_job(ray_cluster, token_data, heldout_data, tmp_path, prometheus,
                                                        monkeypatch):
    # an MoE model (switch, capacity 1: drops happen) counting its bytes, so the MoE and communication rows have
    # data, scoring a held-out loss, so the loss panel's second query has data too
    moe = {"experts": 4, "router": "switch", "capacity_factor": 1.0}
    spec = tiny_spec(token_data, tmp_path, parallel={"pp": 2, "dp": 2}, model={"moe": moe},
                     metrics={"port": 0, "timeline": True, "comm_bytes": True},
                     train={"steps": STEPS}, checkpoint={"every": 10},
                     eval={"every": 5, "path": str(heldout_data), "batches": 1})
    job = spec.name
    prom = prometheus(spec.metrics.resolved_file_sd(spec.resolved_run_dir()))

    early, last = threading.Event(), threading.Event()
    monkeypatch.setattr(PacedExporter, "gates", {HOLD_AT: early, STEPS: last})
    monkeypatch.setattr(observers, "MetricsExporter", PacedExporter)
    outcome: dict = {}

    def run_job():
        try:
            outcome["result"] = TrainingJob(spec, progress=False).run()
        except BaseException as e:  # handed to the test thread below
            outcome["error"] = e

    thread = threading.Thread(target=run_job, name="raymesh-job", daemon=True)
    thread.start()

    # While the job runs: the target is up and steps are counted. T is the timestamp of a scrape of the
    # last step, taken while the job is held there: every series has a real sample at exactly T, whereas
    # after the job ends its target is gone and its series go stale.
    at = None
    try:
        deadline = time.monotonic() + 150
        while thread.is_alive() and time.monotonic() < deadline:
            up = prom.query(f'up{{raymesh_job="{job}"}}')
            steps = prom.query(f'raymesh_steps_total{{job="{job}"}}')
            if any(s["value"][1] == "1" for s in up) and any(float(s["value"][1]) > 5 for s in steps):
                early.set()
            final = prom.query(f'timestamp(raymesh_steps_total{{job="{job}"}}) '
                               f'and raymesh_steps_total{{job="{job}"}} >= {STEPS}')
            if final and thread.is_alive():
                at = float(final[0]["value"][1])
                last.set()
            time.sleep(0.25)
    finally:
        early.set()
        last.set()
        thread.join(timeout=90)
    assert not thread.is_alive(), "the job did not finish"
    if "error" in outcome:
        raise outcome["error"]
    assert outcome["result"].steps == STEPS
    assert at is not None, (f"Prometheus never scraped the job's target at step {STEPS} while the job ran\n"
                            f"{prom.log_tail()}")

    # the dashboard's template variables resolve
    jobs = prom.get("/api/v1/label/job/values", **{"match[]": "raymesh_steps_total"})
    assert job in jobs
    ranks = prom.get("/api/v1/label/rank/values", **{"match[]": f'raymesh_memory_peak_bytes{{job="{job}"}}'})
    assert sorted(ranks, key=int) == ["0", "1", "2", "3"]
    world = {s["metric"]["dim"]: s["value"][1] for s in prom.query(f'raymesh_world_size_ranks{{job="{job}"}}', at)}
    assert world == {"dp": "2", "pp": "2", "tp": "1"}

    empty = []
    for where, expr in panel_exprs(load_dashboard()):
        if "raymesh_dpo" in expr:  # a DPO job (LoRA, no pp or MoE) cannot be this one: tests/unit/test_dpo.py
            continue  # checks its gauge's series and that these panels select only figures it exports
        if not prom.query(concrete(expr, job), at):
            empty.append(f"{where}: {concrete(expr, job)}")
    assert not empty, "panel queries with no data at T:\n" + "\n".join(empty)
