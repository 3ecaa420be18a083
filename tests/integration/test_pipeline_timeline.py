"""The recorded pipeline timeline of real pp=2 runs shows each schedule's bubble and memory behaviour.

Bubbles come from the F/B/W events the stages recorded: measured (wall-clock ratios within one run, checked
loosely against theory for GPipe only) and ordered (the recorded order replayed at ideal costs, exact and free of
this machine's noise: schedules are compared on it). In-flight activations are counted from the event order alone.
"""

from __future__ import annotations

import json
import statistics

import pytest

from orchestrator import TrainingJob
from orchestrator.observability.report import write_report
from orchestrator.planning.bubble import measured_bubble, ordered_bubble, step_events, theoretical_bubble
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped

PP, MICROBATCHES, STEPS = 2, 4, 5
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev")


# GPipe's measured bubble is checked against theory, so its run is big enough that compute, not messaging, fills
# the window; the others are compared on their order, which no duration changes, so they run the tiny model
BIG = {"d_model": 256, "n_layers": 8, "n_heads": 4, "d_ff": 1024, "seq_len": 256}


def _spec(schedule: str, token_data, run_dir):
    return tiny_spec(token_data, run_dir, model=BIG if schedule == "gpipe" else {},
                     parallel={"pp": PP, "pp_schedule": schedule},
                     train={"steps": STEPS, "global_batch_size": 16, "microbatches": MICROBATCHES},
                     metrics={"timeline": True})


@pytest.fixture(scope="module")
def runs(ray_cluster, token_data, tmp_path_factory):
    """One real pp=2 run per schedule: GPipe's through Ray (its run dir's records feed the report test), the others
    without Ray in one spawn (``run_grouped``: the timeline is the ranks' own events either way, which the
    controller only writes to ``timeline.jsonl``)."""
    run_dir = tmp_path_factory.mktemp("gpipe")
    spec = _spec("gpipe", token_data, run_dir)
    TrainingJob(spec, progress=False).run()
    timeline = [json.loads(line) for line in (spec.resolved_run_dir() / "timeline.jsonl").read_text().splitlines()]
    out = {"gpipe": {"run_dir": spec.resolved_run_dir(), "timeline": timeline}}
    others = {s: _spec(s, token_data, tmp_path_factory.mktemp(s)) for s in SCHEDULES if s != "gpipe"}
    spawned = run_grouped(others)
    for schedule in others:
        results = ran(spawned, schedule).results
        out[schedule] = {"timeline": [e for steps in results.values() for step in steps for e in step["timeline"]]}
    return out


def bubble(run) -> float:
    """Median measured bubble over the steps after the first (warm-up) one."""
    return statistics.median(measured_bubble(step_events(run["timeline"], s)) for s in range(2, STEPS + 1))


def ordered(run) -> float:
    """The bubble of the last step's recorded order at ideal costs (``ordered_bubble``); every step's is the same."""
    return ordered_bubble(step_events(run["timeline"], STEPS))


def peak_in_flight(run, pp_rank: int = 0) -> int:
    """Most microbatches whose forward ran on ``pp_rank`` but whose backward had not, in the last step."""
    events = sorted((e for e in step_events(run["timeline"], STEPS) if e["pp_rank"] == pp_rank),
                    key=lambda e: e["start"])
    live = peak = 0
    for e in events:
        live += {"F": 1, "B": -1}.get(e["kind"], 0)
        peak = max(peak, live)
    return peak


def test_every_microbatch_runs_forward_and_backward_on_every_stage(runs):
    for schedule, run in runs.items():
        events = step_events(run["timeline"], STEPS)
        stages = {e["stage"] for e in events}
        for kind in ("F", "B"):
            got = sorted((e["stage"], e["microbatch"]) for e in events if e["kind"] == kind)
            assert got == sorted((s, m) for s in stages for m in range(MICROBATCHES)), (schedule, kind)


def test_gpipe_bubble_matches_theory(runs):
    assert ordered(runs["gpipe"]) == pytest.approx(theoretical_bubble(PP, MICROBATCHES), rel=1e-9)
    assert bubble(runs["gpipe"]) == pytest.approx(theoretical_bubble(PP, MICROBATCHES), abs=0.1)


def test_1f1b_same_bubble_as_gpipe_with_fewer_activations_in_flight(runs):
    assert ordered(runs["1f1b"]) == pytest.approx(ordered(runs["gpipe"]), rel=1e-9)
    assert peak_in_flight(runs["gpipe"]) == MICROBATCHES
    assert peak_in_flight(runs["1f1b"]) == PP


def test_interleaving_divides_the_bubble_by_the_stages_per_rank(runs):
    assert ordered(runs["interleaved_1f1b"]) == pytest.approx(theoretical_bubble(PP, MICROBATCHES, 2), rel=1e-9)


def test_zero_bubble_schedules_show_the_smallest_bubble(runs):
    """Measured on this machine, their bubbles swapped places with interleaved 1F1B's from run to run (messaging
    dominates a tiny model's pipeline); the order they ran in is what makes them zero-bubble."""
    others = min(ordered(runs[s]) for s in ("gpipe", "1f1b", "interleaved_1f1b"))
    for schedule in ("interleaved_zero_bubble", "zbv", "dualpipev"):
        assert ordered(runs[schedule]) < 0.5 * others, schedule
        assert any(e["kind"] == "W" for e in runs[schedule]["timeline"]), schedule


def test_report_draws_the_timeline_of_a_real_run(runs):
    report = write_report(runs["gpipe"]["run_dir"])
    names = {p.rsplit("/", 1)[-1] for p in report["pngs"]}
    assert {"loss.png", "throughput.png", "step_breakdown.png", "memory.png", "pipeline_timeline.png"} <= names
    assert report["bubble"]["theoretical"] == pytest.approx(theoretical_bubble(PP, MICROBATCHES))
    assert report["bubble"]["ordered"] == pytest.approx(ordered(runs["gpipe"]))
