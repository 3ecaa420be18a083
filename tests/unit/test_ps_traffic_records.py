"""Parameter-server traffic reaches the step record and Prometheus: each rank's push and pull payload bytes
(summed over ranks) and its stalest asp/ssp read (the largest over ranks), counted by the client from the
shards' replies; an asynchronous step's gradient norm is the replicas' mean, not rank 0's."""

from __future__ import annotations

import math

import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.observability.prometheus import MetricsExporter
from orchestrator.observability.run_records import step_record
from parameter_server.client import PSClient
from parameter_server.shard import PSShard
from tests.support.ps_local import LocalConn
from workers.loop.summary import StepSummary
from workers.protocol import StepResult, StepTimes


def _result(rank: int, ps: dict | None) -> StepResult:
    return StepResult(rank=rank, step=1, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=8, applied=True,
                      time_s=StepTimes(step=1.0), peak_memory_bytes=1, current_memory_bytes=1, ps=ps)


def _record(*traffic: dict | None, step: int = 1) -> dict:
    record = step_record(StepSummary.of_all([_result(r, t) for r, t in enumerate(traffic)]), 1.0, 8, 0.0, 0.0)
    return {**record, "loss": 2.0, "tokens_per_s": 8.0, "phases": {}, "step": step}


def test_step_record_sums_bytes_and_keeps_the_stalest_read():
    record = _record({"push": 100, "pull": 40, "staleness": 0}, {"push": 60, "pull": 40, "staleness": 2})
    assert record["ps"] == {"push_bytes": 160, "pull_bytes": 80, "staleness": 2}
    assert "ps" not in _record(None) and "ps" not in _result(0, None).to_dict()


def test_an_asynchronous_step_reports_the_mean_of_the_replicas_norms_not_rank_0s():
    """asp/ssp: a rank that ran no local step this controller step reports NaN; rank 0 being that rank must not make
    the step's norm NaN (it read NaN in a finished run without fp16). Synchronous steps keep rank 0's, the job's."""
    def result(rank: int, norm: float, local_steps: int | None) -> StepResult:
        return StepResult(rank=rank, step=3, loss=2.0, grad_norm=norm, lr=1e-3, tokens=8, applied=True,
                          time_s=StepTimes(step=1.0), peak_memory_bytes=1, current_memory_bytes=1,
                          local_steps=local_steps)

    def norm(*per_rank: tuple[float, int | None]) -> float:
        ranks = StepSummary.of_all([result(r, n, k) for r, (n, k) in enumerate(per_rank)])
        return step_record(ranks, 1.0, 8, 0.0, 0.0)["grad_norm"]

    nan = float("nan")
    assert norm((nan, 0), (2.0, 2), (4.0, 1)) == 3.0
    assert math.isnan(norm((nan, 1), (nan, 1)))  # every replica's step overflowed in fp16
    assert norm((1.5, None), (1.5, None)) == 1.5 and math.isnan(norm((nan, None), (2.0, None)))


def test_exporter_counts_the_bytes_and_sets_the_staleness():
    exporter = MetricsExporter("j", 0)
    try:
        exporter.observe_step(_record({"push": 100, "pull": 40, "staleness": 1}), 0.0, 0.0, 1.0)
        exporter.observe_step(_record({"push": 100, "pull": 40, "staleness": 0}, step=2), 0.0, 0.0, 1.0)
        samples = {s.name: s.value for f in text_string_to_metric_families(generate_latest(exporter.registry)
                                                                           .decode()) for s in f.samples}
        assert samples["raymesh_ps_push_bytes_total"] == 200 and samples["raymesh_ps_pull_bytes_total"] == 80
        assert samples["raymesh_ps_staleness_steps"] == 0  # the last step's
    finally:
        exporter.close()


def test_client_counts_payload_and_read_staleness_from_the_shards_replies():
    """An ssp reader at clock 3 whose stage's slower worker has 1 push applied reads 2 steps stale; a pull
    without a clock (an outside reader) records no staleness."""
    sgd = {"name": "sgd", "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}
    conns = [LocalConn(PSShard(0, "ssp", sgd, 2, [0.1] * 8))]
    reader, slow = (PSClient(conns, chunk_elems=8, vnodes=4, worker=w) for w in (0, 1))
    reader.register({"w": torch.zeros(20)})
    slow.layout = dict(reader.layout)
    for clock in range(3):
        reader.push(clock, {"w": torch.ones(20)})
    slow.push(0, {"w": torch.ones(20)})
    assert reader.take_traffic() == {"push": 3 * 20 * 4, "pull": 0, "staleness": 0}
    reader.pull(["w"], clock=3)
    assert reader.take_traffic() == {"push": 0, "pull": 20 * 4, "staleness": 2}
    reader.pull(["w"])
    assert reader.take_traffic() == {"push": 0, "pull": 20 * 4, "staleness": 0}
