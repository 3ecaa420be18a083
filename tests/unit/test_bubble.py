"""Bubble math: an ideal GPipe timeline measures exactly the (p−1)/(m+p−1) of the seed articles, and so does its
recorded order replayed at ideal costs, whatever the events' real durations."""

from __future__ import annotations

import pytest

from orchestrator.planning.bubble import (
    bubble_by_step,
    measured_bubble,
    ordered_bubble,
    step_events,
    theoretical_bubble,
)
from tests.support.timelines import T0, gpipe_timeline


def test_ideal_gpipe_measures_the_theoretical_bubble():
    events = gpipe_timeline(p=4, m=8)
    assert measured_bubble(events) == pytest.approx(theoretical_bubble(4, 8), rel=1e-12)
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)


@pytest.mark.parametrize("p,m", [(1, 4), (2, 2), (3, 5), (8, 16)])
def test_ideal_gpipe_matches_theory_for_other_shapes(p, m):
    assert measured_bubble(gpipe_timeline(p, m, f=1.0, b=2.0)) == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)


def test_interleaving_divides_the_bubble_by_v():
    assert theoretical_bubble(4, 8, virtual_stages=2) == pytest.approx(3 / (16 + 3))
    def bubble_time(v):
        return theoretical_bubble(4, 8, v) / (1 - theoretical_bubble(4, 8, v))  # bubble / ideal
    assert bubble_time(1) / bubble_time(2) == pytest.approx(2)


@pytest.mark.parametrize("args", [(0, 8), (4, 0), (4, 8, 0)])
def test_theoretical_bubble_refuses_empty_pipelines(args):
    with pytest.raises(ValueError, match=">= 1"):
        theoretical_bubble(*args)


def test_overlapping_events_count_once():
    def ev(pp, start, end):
        return {"step": 1, "rank": pp, "pp_rank": pp, "stage": pp, "microbatch": 0, "kind": "B",
                                     "start": start, "end": end}
    # pp 0: [0,2] ∪ [1,3] ∪ [1.5,2.5] = [0,3], fully busy; pp 1: [0,1] ∪ [2,3] = 2 of 3 busy
    events = [ev(0, 0, 2), ev(0, 1, 3), ev(0, 1.5, 2.5), ev(1, 0, 1), ev(1, 2, 3)]
    assert measured_bubble(events) == pytest.approx((0 + 1 / 3) / 2)


def test_measured_bubble_needs_events():
    with pytest.raises(ValueError):
        measured_bubble([])


def test_step_events_picks_one_replica_per_step():
    timeline = gpipe_timeline(4, 8, step=1, dp=2) + gpipe_timeline(4, 8, step=2, dp=2, t0=T0 + 100)
    events = step_events(timeline, 2)
    assert {e["rank"] for e in events} == {0, 1, 2, 3}
    assert {e["step"] for e in events} == {2}
    assert len(events) == 4 * 8 * 2
    # mixing the two replicas (shifted by 0.5 s) would change the bubble; one replica keeps theory
    assert bubble_by_step(timeline) == pytest.approx({1: 3 / 11, 2: 3 / 11})


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_the_recorded_order_replayed_gives_the_schedules_bubble_whatever_the_durations(p, m):
    """Messaging between stages (here half a forward per message) adds to the measured bubble but not to the
    order; replayed at ideal costs it gives theory exactly."""
    slow = gpipe_timeline(p, m, latency=0.5)
    assert measured_bubble(slow) > theoretical_bubble(p, m) + 0.01
    assert ordered_bubble(slow) == pytest.approx(theoretical_bubble(p, m), rel=1e-12)


def test_weight_passes_fill_the_gap_a_later_stages_backward_leaves():
    """p=2, m=1: stage 0 waits for stage 1's backward either way; with the backward split into B and W, stage 1's
    W runs while stage 0 does its B, so the step is one unit shorter than F,F,B(2),B(2)."""
    def ev(pp, kind, start):
        return {"step": 1, "rank": pp, "pp_rank": pp, "stage": pp, "microbatch": 0, "kind": kind,
                "start": start, "end": start + 0.1}
    whole = [ev(0, "F", 0), ev(1, "F", 1), ev(1, "B", 2), ev(0, "B", 3)]
    split = [ev(0, "F", 0), ev(1, "F", 1), ev(1, "B", 2), ev(1, "W", 3), ev(0, "B", 3.5), ev(0, "W", 4)]
    assert ordered_bubble(whole) == pytest.approx(1 - 3 / 6)  # each rank busy 3 of a 6-unit step
    assert ordered_bubble(split) == pytest.approx(1 - 3 / 5)  # F, B, W at 1 each; the step ends at 5


def test_an_order_that_waits_on_itself_is_named():
    events = [{"step": 1, "rank": 0, "pp_rank": 0, "stage": 0, "microbatch": 0, "kind": "B", "start": 0.0,
               "end": 1.0},
              {"step": 1, "rank": 0, "pp_rank": 0, "stage": 0, "microbatch": 0, "kind": "F", "start": 1.0,
               "end": 2.0}]
    with pytest.raises(ValueError, match=r"waits on itself .*0: \('B', 0, 0\)"):
        ordered_bubble(events)
    with pytest.raises(ValueError, match="at least one event"):
        ordered_bubble([])
