"""The controller's Prometheus exporter: one endpoint for the whole job.

Ranks report to the controller in their step results; the controller turns
them into metrics, so Prometheus scrapes one target per job, not one per rank.
Names follow Prometheus conventions: ``raymesh_`` prefix, base units in the
name, ``_total`` for counters.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import ray
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from orchestrator.observability.figures import Exported

RANK_LABELS = ("job", "rank", "stage", "dp", "pp", "tp")  # stage: the rank's pipeline stages, e.g. "0,2"
# every kind a recovery can have (StepFailed.kind, "node" for a lost node, "controller" for the hosted controller's
# own process, restarted by Ray), a corrupt checkpoint set aside and a parameter-server shard restarted (the
# summary's kill_ps_shard), exported at 0 from the start so rates and panels have series
RECOVERY_KINDS = ("rank", "node", "hang", "oom", "error", "nan_loss", "controller", "corrupt_checkpoint", "ps_shard",
                  "preempt", "drain")


class _HeartbeatAge:
    """Seconds since each rank last reported, computed when Prometheus scrapes (a hang shows as growth)."""

    def __init__(self, job: str):
        self.job = job
        self.last_seen: dict[tuple, float] = {}  # per rank: when it joined, or its own last report
        self.every_rank_at = 0.0  # the last completed step: every rank took part in it (one time, not one per rank)

    def collect(self):
        family = GaugeMetricFamily("raymesh_heartbeat_age_seconds", "Seconds since the rank last reported",
                                   labels=RANK_LABELS)
        now = time.time()
        for labels, seen in self.last_seen.items():
            family.add_metric(labels, now - max(seen, self.every_rank_at))
        yield family


def _replace_text(path: Path, text: str) -> None:
    """``text`` at ``path`` by a rename. Why: Prometheus re-reads a target file as soon as it changes; written in
    place it can read it truncated, log a parse error and keep its old targets until the next change or refresh
    (minutes), e.g. go on scraping a job that emptied the file as it stopped. The temporary name ends in ``.tmp``,
    which a ``*.json`` ``file_sd`` glob does not match."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class MetricsExporter:
    def __init__(self, job: str, port: int, host: str = "127.0.0.1"):
        """Serve on ``host`` (loopback unless the job's ``metrics.host`` widens it: the metrics name the job, its
        layout and its nodes, which nobody off this machine needs unless a Prometheus there scrapes them)."""
        self.job = job
        self.host = host
        self.registry = r = CollectorRegistry()
        j = ("job",)
        self.steps = Counter("raymesh_steps_total", "Optimizer steps completed", j, registry=r)
        self.tokens = Counter("raymesh_tokens_total", "Tokens trained on", j, registry=r)
        self.loss = Gauge("raymesh_loss", "Training loss of the last step", j, registry=r)
        self.grad_norm = Gauge("raymesh_grad_norm", "Global gradient norm before clipping", j, registry=r)
        self.lr = Gauge("raymesh_learning_rate", "Learning rate of the last step", j, registry=r)
        self.step_seconds = Histogram(
            "raymesh_step_duration_seconds", "Wall time of one step seen by the controller", j, registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.phase = Gauge("raymesh_step_phase_seconds", "Time of the last step spent per phase, per rank",
                           (*RANK_LABELS, "phase"), registry=r)
        self.tokens_per_s = Gauge("raymesh_tokens_per_second", "Throughput of the last step", j, registry=r)
        self.mfu = Gauge("raymesh_model_flops_utilization_ratio",
                         "Model FLOPs (6·N + 12·L·d·s per token) per second over the ranks' peak", j, registry=r)
        self.peak_mem = Gauge("raymesh_memory_peak_bytes", "Peak memory per rank", RANK_LABELS, registry=r)
        self.cur_mem = Gauge("raymesh_memory_current_bytes", "Current memory per rank", RANK_LABELS, registry=r)
        self.heartbeat = _HeartbeatAge(job)
        r.register(self.heartbeat)
        self.ckpt_seconds = Histogram("raymesh_checkpoint_duration_seconds", "Blocking time of a checkpoint save",
                                      j, registry=r, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
        self.ckpts = Counter("raymesh_checkpoints_total", "Checkpoints committed (durable on storage)", j, registry=r)
        self.world = Gauge("raymesh_world_size_ranks", "Ranks in the job, per parallel dimension",
                           ("job", "dim"), registry=r)
        self.bubble = Gauge("raymesh_pipeline_bubble_ratio",
                            "Idle fraction of the pipeline window in the last step (0 without pp)", j, registry=r)
        self.recoveries = Counter("raymesh_recoveries_total", "Recoveries from faults", ("job", "kind"), registry=r)
        self.restarts = Counter("raymesh_restarts_total", "Rank actors restarted", j, registry=r)
        self.lost_steps = Counter("raymesh_lost_steps_total", "Steps recomputed after recoveries", j, registry=r)
        self.mttr = Gauge("raymesh_mttr_seconds", "Time from the last fault to the next completed step", j, registry=r)
        self.straggler = Gauge("raymesh_straggler", "1 while the rank is reported as a straggler, else 0",
                               RANK_LABELS, registry=r)
        self.slowdown = Gauge("raymesh_step_slowdown_ratio", "The rank's step time over the other ranks' median",
                              RANK_LABELS, registry=r)
        self.goodput = Gauge("raymesh_goodput_ratio", "Productive step time over wall time since start", j, registry=r)
        self.figures = Exported(r, job)  # each per-step figure's series (observability/figures.py)
        self._file_sd: Path | None = None
        self.rank_labels: dict[int, tuple] = {}
        self._phases: set[str] = set()  # every phase a step reported, to drop a departed rank's
        self._start_series()
        self.server, self.thread = start_http_server(port, addr=host, registry=r)
        self.port = self.server.server_port

    def _start_series(self) -> None:
        """Every recovery kind and counter at 0, and the gauges read before the first step or fault, once: so
        rates and panels have series, and a later layout change (a resize) does not zero the last MTTR."""
        for kind in RECOVERY_KINDS:
            self.recoveries.labels(self.job, kind)
        for counter in (self.restarts, self.lost_steps, self.ckpts):
            counter.labels(self.job)
        self.mttr.labels(self.job).set(0)

    def observe_layout(self, layout: dict) -> None:
        """The grid's ranks and sizes, at start and after each resize. Ranks a resize removed or moved (other
        labels) lose their per-rank series: a departed rank's heartbeat age would grow as a hang's does, and its
        last straggler flag stay raised. A rank's heartbeat starts when it joins, so a hang in its first step
        shows too."""
        labels = {info["rank"]: (self.job, str(info["rank"]), ",".join(map(str, info["stages"])),
                                 *(str(info["coords"][d]) for d in ("dp", "pp", "tp")))
                  for info in layout["ranks"]}
        for gone in set(self.rank_labels.values()) - set(labels.values()):
            self._drop_rank(gone)
        self.rank_labels = labels
        now = time.time()
        for rank in labels.values():
            self.heartbeat.last_seen.setdefault(rank, now)
        for dim in ("dp", "pp", "tp"):
            self.world.labels(self.job, dim).set(layout[dim])

    def _drop_rank(self, labels: tuple) -> None:
        """Remove every per-rank series of the rank with ``labels``."""
        self.heartbeat.last_seen.pop(labels, None)
        for gauge in (self.peak_mem, self.cur_mem, self.straggler, self.slowdown):
            gauge.remove(*labels)
        for phase in self._phases:
            self.phase.remove(*labels, phase)

    def observe_step(self, record: dict, mfu: float, bubble: float, goodput: float) -> None:
        """Export one ``steps.jsonl`` record (see ``orchestrator.observability.run_records``)."""
        j = self.job
        self.steps.labels(j).inc()
        self.tokens.labels(j).inc(record["tokens"])
        self.loss.labels(j).set(record["loss"])
        self.grad_norm.labels(j).set(record["grad_norm"])
        self.lr.labels(j).set(record["lr"])
        self.step_seconds.labels(j).observe(record["step_s"])
        self.tokens_per_s.labels(j).set(record["tokens_per_s"])
        self.mfu.labels(j).set(mfu)
        self.bubble.labels(j).set(bubble)
        self.goodput.labels(j).set(goodput)
        self.figures.observe(record)
        self.heartbeat.every_rank_at = time.time()  # a completed step: every rank reported, whatever its detail
        for rank, phases in record.get("phases", {}).items():  # a step with per-rank detail
            labels = self.rank_labels[int(rank)]
            for phase, seconds in phases.items():
                self.phase.labels(*labels, phase).set(seconds)
                self._phases.add(phase)
            self.peak_mem.labels(*labels).set(record["memory"][rank]["peak_bytes"])
            self.cur_mem.labels(*labels).set(record["memory"][rank]["current_bytes"])

    def observe_stragglers(self, ratios: dict[int, float], flagged: set[int]) -> None:
        """Every rank's slowdown ratio and straggler flag (0 too, so the panels have a series per rank)."""
        for rank, ratio in ratios.items():
            labels = self.rank_labels[rank]
            self.slowdown.labels(*labels).set(ratio)
            self.straggler.labels(*labels).set(1 if rank in flagged else 0)

    def observe_recovery(self, kind: str, restarted: int, lost_steps: int) -> None:
        self.recoveries.labels(self.job, kind).inc()
        self.restarts.labels(self.job).inc(restarted)
        self.lost_steps.labels(self.job).inc(lost_steps)

    def observe_checkpoint(self, blocking_s: float | None, committed: bool) -> None:
        """A save's blocking time when it was issued; the commit count when it became durable."""
        if blocking_s is not None:
            self.ckpt_seconds.labels(self.job).observe(blocking_s)
        if committed:
            self.ckpts.labels(self.job).inc()

    def address(self) -> str:
        """host:port as Prometheus reaches it (the node's IP when listening on every interface)."""
        host = ray.util.get_node_ip_address() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{self.port}"

    def write_file_sd(self, path: str | Path) -> None:
        """A Prometheus ``file_sd_configs`` target file pointing at this exporter."""
        self._file_sd = Path(path)
        self._file_sd.parent.mkdir(parents=True, exist_ok=True)
        _replace_text(self._file_sd, json.dumps([{"targets": [self.address()], "labels": {"raymesh_job": self.job}}]))

    def close(self) -> None:
        """Stop serving, and empty the target file so Prometheus drops the target instead of scraping a dead one."""
        if self._file_sd is not None:
            _replace_text(self._file_sd, "[]")
        self.server.shutdown()
        self.server.server_close()
