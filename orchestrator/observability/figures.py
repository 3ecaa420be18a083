"""How the controller's readers show each per-step figure of a ``steps.jsonl`` record: its Prometheus series, its
tracker metrics, its fields on the ``event=step`` line.

The worker side reduces a figure over the ranks (``workers/contract/figures.py``: one reducer per key, which
``run_records.step_record`` folds); this is the other half, one ``RecordView`` per record key, so the exporter,
the trackers and the event log loop over ``VIEWS`` instead of naming each feature. A figure no view names is
still in ``steps.jsonl``; a new view is one entry here.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge


class RecordView:
    """One record key's readers; each reads the key's value only when the record has it."""

    key = ""

    def metrics(self, registry: CollectorRegistry, job: str) -> None:
        """Create this figure's Prometheus series in ``registry`` (once per exporter), started where a panel
        needs a series before the first step."""

    def observe(self, value: Any, job: str) -> None:
        """Set the series from one step's value."""

    def tracker(self, value: Any) -> dict[str, float]:
        """The tracker metrics of one step's value (the same names in every tracker)."""
        return {}

    def event(self, value: Any) -> dict[str, str]:
        """Fields on the logged ``event=step`` line."""
        return {}


class EvalLossView(RecordView):
    key = "eval_loss"

    def metrics(self, registry, job):
        self.gauge = Gauge("raymesh_eval_loss", "Held-out loss of the last evaluation (eval.every)", ("job",),
                           registry=registry)

    def observe(self, value, job):
        self.gauge.labels(job).set(value)

    def tracker(self, value):
        return {} if value is None else {"eval_loss": value}


class DPOView(RecordView):
    """``train.objective: dpo``: the reward figures (TRL's ``rewards/*`` as ``dpo/*``); the step line carries
    accuracy and margin, what a preference run is watched by."""

    key = "dpo"

    def metrics(self, registry, job):
        self.gauge = Gauge("raymesh_dpo", "DPO's figures of the last step's global batch (train.objective: dpo): "
                           "reward_accuracy, chosen_reward, rejected_reward, reward_margin", ("job", "figure"),
                           registry=registry)

    def observe(self, value, job):
        for figure, number in (value or {}).items():
            self.gauge.labels(job, figure).set(number)

    def tracker(self, value):
        return {f"dpo/{k}": v for k, v in (value or {}).items()}

    def event(self, value):
        rewards = value or {}
        return {k: f"{rewards[k]:.3f}" for k in ("reward_accuracy", "reward_margin") if k in rewards}


class MTPView(RecordView):
    """``model.mtp_layers``: the multi-token prediction loss beside the next-token ``loss`` (which it leaves as is)."""

    key = "mtp"

    def tracker(self, value):
        depths = {f"mtp/depth_{k}": v for k, v in enumerate((value or {}).get("depths", []), start=1)}
        return {} if value is None else {"mtp/loss": value["loss"], **depths}

    def event(self, value):
        return {} if value is None else {"mtp_loss": f"{value['loss']:.4f}"}


class CommBytesView(RecordView):
    key = "comm_bytes"

    def metrics(self, registry, job):
        self.gauge = Gauge("raymesh_comm_bytes", "Bytes the busiest rank's collectives sent in the last step, "
                           "per mesh dimension (metrics.comm_bytes)", ("job", "dim"), registry=registry)

    def observe(self, value, job):
        for dim, sent in value.items():
            self.gauge.labels(job, dim).set(sent)


class PSTrafficView(RecordView):
    """``dp_sync: ps``: counters and staleness start at 0 for every job (0 under all-reduce, as the panels say)."""

    key = "ps"

    def metrics(self, registry, job):
        self.push = Counter("raymesh_ps_push_bytes_total", "Bytes pushed to parameter-server shards", ("job",),
                            registry=registry)
        self.pull = Counter("raymesh_ps_pull_bytes_total", "Bytes pulled from parameter-server shards", ("job",),
                            registry=registry)
        self.staleness = Gauge("raymesh_ps_staleness_steps", "Largest clock gap between a read and the newest "
                               "update (0 under all-reduce)", ("job",), registry=registry)
        self.push.labels(job)
        self.pull.labels(job)
        self.staleness.labels(job).set(0)

    def observe(self, value, job):
        self.push.labels(job).inc(value["push_bytes"])
        self.pull.labels(job).inc(value["pull_bytes"])
        self.staleness.labels(job).set(value["staleness"])


class MoEView(RecordView):
    """Each MoE layer's figures (``workers.model.moe.step_figures``)."""

    key = "moe"

    def metrics(self, registry, job):
        moe = ("job", "layer")
        self.tokens = Gauge("raymesh_moe_expert_tokens", "Token assignments an expert took in the last step "
                            "(all data-parallel ranks, after drops)", (*moe, "expert"), registry=registry)
        self.drops = Gauge("raymesh_moe_drop_ratio", "Share of the last step's wanted expert assignments "
                           "dropped for capacity (expert choice: tokens no expert picked)", moe, registry=registry)
        self.balance = Gauge("raymesh_moe_load_imbalance", "Busiest expert's load over the mean load in the "
                             "last step (1 is perfect balance)", moe, registry=registry)
        self.aux = Gauge("raymesh_moe_aux_loss", "The MoE layer's weighted auxiliary losses in the last step",
                         (*moe, "loss"), registry=registry)

    def observe(self, value, job):
        for layer, figures in value.items():
            labels = (job, layer)
            for expert, tokens in enumerate(figures["tokens_per_expert"]):
                self.tokens.labels(*labels, str(expert)).set(tokens)
            self.drops.labels(*labels).set(figures["drop_fraction"])
            self.balance.labels(*labels).set(figures["balance"])
            for name, number in figures.items():
                if name.startswith("aux_"):
                    self.aux.labels(*labels, name[4:]).set(number)


VIEWS: list[RecordView] = [EvalLossView(), DPOView(), MTPView(), CommBytesView(), PSTrafficView(), MoEView()]


def tracker_metrics(record: dict) -> dict[str, float]:
    """Every view's tracker metrics of one step record."""
    return {k: v for view in VIEWS if view.key in record for k, v in view.tracker(record[view.key]).items()}


def event_fields(record: dict) -> dict[str, str]:
    """Every view's fields on the record's ``event=step`` line."""
    return {k: v for view in VIEWS if view.key in record for k, v in view.event(record[view.key]).items()}


class Exported:
    """The Prometheus series of every view, in one exporter's registry."""

    def __init__(self, registry: CollectorRegistry, job: str):
        self.job = job
        self.views = [type(view)() for view in VIEWS]  # each exporter's own series
        for view in self.views:
            view.metrics(registry, job)

    def observe(self, record: dict) -> None:
        for view in self.views:
            if view.key in record:
                view.observe(record[view.key], self.job)
