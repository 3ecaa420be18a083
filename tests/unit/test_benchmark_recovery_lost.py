"""``benchmarks/recovery.py``'s seconds lost per failure, from a run's own records (``time_lost``): what counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.recovery import time_lost


def _line(step: int, time: float, step_s: float = 0.2, replicas: int | None = None) -> dict:
    line = {"step": step, "time": time, "step_s": step_s}
    return line if replicas is None else {**line, "replicas": replicas}


def test_recovery_rejoin_pause_and_skipped_share_add_up_per_failure():
    """dp=4, one failure: the survivors' next step 1.2 s after the fault (MTTR) less a 0.2 s median step; two
    steps run by three replicas (a quarter of each skipped); the rejoin after step 5 held every rank 0.6 s, and the
    rejoined group's first step took 0.5 s: 0.3 s more than a median step, lost too."""
    job = SimpleNamespace(spec=SimpleNamespace(parallel=SimpleNamespace(dp=4)))
    lines = [_line(1, 10.2), _line(2, 10.4), _line(3, 11.6, replicas=3), _line(4, 11.8, 0.4, replicas=3),
             _line(5, 12.0), _line(6, 13.1, 0.5)]
    result = SimpleNamespace(step_time_s=[0.2, 0.2, 0.2, 0.4, 0.2, 0.5],
                             recoveries=[{"mttr_s": 1.2, "lost_steps": 0, "rejoined_at_step": 5, "rejoin_s": 0.7}])
    out = time_lost(job, result, lines, every_s=60)
    parts = out["lost_s_per_failure_parts"]
    assert parts["recovery"] == pytest.approx(1.0)
    assert parts["rejoin"] == pytest.approx(13.1 - 12.0 - 0.2)  # less a median step, not that slow step's 0.5 s
    assert parts["skipped"] == pytest.approx((0.2 + 0.4) / 4)
    assert out["lost_s_per_failure"] == pytest.approx(1.0 + 0.9 + 0.15)
    assert out["goodput_at_failure_every_s"] == pytest.approx(1 - 2.05 / 60)


def test_the_default_recovery_costs_its_mttr_and_lost_steps_and_a_rejoin_at_the_end_its_recorded_seconds():
    job = SimpleNamespace(spec=SimpleNamespace(parallel=SimpleNamespace(dp=8)))
    result = SimpleNamespace(step_time_s=[0.1] * 5, recoveries=[
        {"mttr_s": 3.1, "lost_steps": 2}, {"mttr_s": 0.5, "lost_steps": 0, "rejoined_at_step": 5, "rejoin_s": 0.8}])
    lines = [_line(s, s * 0.1, 0.1) for s in range(1, 6)]
    out = time_lost(job, result, lines, every_s=60)
    assert out["lost_s_per_failure_parts"]["recovery"] == pytest.approx((3.0 + 0.2 + 0.4) / 2)
    assert out["lost_s_per_failure_parts"]["rejoin"] == pytest.approx(0.8 / 2)  # no step after it: as recorded
    assert time_lost(job, SimpleNamespace(step_time_s=[0.1], recoveries=[]), lines, 60) == {}
