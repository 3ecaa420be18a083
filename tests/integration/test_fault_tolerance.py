"""Restart only what failed, from memory, and lose nothing: compared with an uninterrupted run.

The uninterrupted runs train in the Ray-free harness (``straights``): the same ``Trainer`` on spawned ranks gives
the Ray job's losses bit for bit (no fault, no controller decision changes a bit), and the module's runs of one
world size share one spawn instead of each starting a controller and its own rank actors.

A NaN step rolled back and a hung rank detected by its heartbeat and replaced are tested in
``test_chaos.py``, whose schedule holds every rank fault kind once (each recovery checked by kind, step and
source, the run bit-identical): a job of their own here would repeat that one.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
from pathlib import Path

import pytest
from ray.util.state import get_actor

from orchestrator import JobSpec, TrainingJob
from orchestrator.observability.observers import JobObserver
from orchestrator.runtime.rank_group import STACKS_S, WHERE_S
from tests.support.jobs import ON_DEFAULTS, tiny_spec
from tests.support.live_job import start_live
from tests.support.parity_harness import ran, run_grouped
from tests.support.reference import reference_losses

STEPS = 20
FAST_DETECTION = {"heartbeat_timeout_s": 20, "collective_timeout_s": 5}
CALL_SLACK_S = 1.0  # a poll's round trip to rank 0's actor, on top of its wait (a loaded 2-core machine)


def _spec(token_data, tmp_path, **sections) -> JobSpec:
    defaults = {"train": {"steps": STEPS}, "checkpoint": {"memory_every": 1}, "fault_tolerance": FAST_DETECTION}
    return tiny_spec(token_data, tmp_path, **{**defaults, **sections})


def run(token_data, tmp_path, faults=(), **sections):
    spec = _spec(token_data, tmp_path, **sections)
    return TrainingJob(JobSpec.from_dict({**spec.to_dict(), "faults": list(faults)}), progress=False).run()


def held_out(heldout_data) -> dict:
    return {"every": 4, "path": str(heldout_data), "batches": 2}


CP = {"parallel": {"cp": 2, "cp_impl": "ring"}, "train": {"steps": 8}}
EP = {"parallel": {"dp": 4, "ep": 2}, "train": {"steps": 6, "global_batch_size": 8},
      "model": {"moe": {"experts": 4, "router": "topk", "top_k": 2, "group": "sequence"}}}
COMPRESSED = {
    "powersgd": {"parallel": {"dp": 2, "grad_compression": "powersgd", "powersgd_warmup_steps": 2, "bucket_mb": 0.01},
                 "train": {"steps": 8}},
    "onebit_adam": {"parallel": {"dp": 2}, "optim": {"name": "onebit_adam", "warmup_steps": 2}, "train": {"steps": 8}},
}


@pytest.fixture(scope="module")
def straights(token_data, heldout_data, tmp_path_factory):
    """Every uninterrupted run the module compares with, by name. The dp=2 one scores its held-out loss after
    every 4th step, which changes no bit of its training (tests/integration/test_eval_parity.py)."""
    tmp = tmp_path_factory.mktemp("straights")
    sections = {"pp2-dp2": {"parallel": {"pp": 2, "dp": 2}}, "tp2-dp2": {"parallel": {"tp": 2, "dp": 2}},
                "dp2": {"parallel": {"dp": 2}, "eval": held_out(heldout_data)},
                "dp2-30": {"parallel": {"dp": 2}, "train": {"steps": 30}}, "cp2": CP, "ep": EP, **COMPRESSED}
    return run_grouped({name: _spec(token_data, tmp / name, **s) for name, s in sections.items()})


@pytest.fixture
def straight(straights):
    """The uninterrupted dp=2 run of STEPS steps."""
    return ran(straights, "dp2")


@pytest.mark.parametrize("layout", [{"pp": 2, "dp": 2}, {"tp": 2, "dp": 2}], ids=["pp2-dp2", "tp2-dp2"])
def test_kill_rank_recovers_bit_identical_replacing_only_the_dead_rank(layout, ray_cluster, token_data, tmp_path,
                                                                     straights):
    """On the job file's defaults (no recovery tuning): snapshots every step, survivors freed at once, the warm
    spare takes the dead rank's place."""
    straight = ran(straights, "-".join(f"{k}{v}" for k, v in layout.items()))
    recovered = run(token_data, tmp_path / "killed", parallel=layout, **ON_DEFAULTS,
                    faults=[{"kind": "kill_rank", "rank": 1, "at_step": 7}])
    assert recovered.losses == straight.losses  # bit-identical at every step, before and after the fault
    assert recovered.grad_norms == straight.grad_norms
    (rec,) = recovered.recoveries
    assert (rec["kind"], rec["rank"], rec["at_step"], rec["source"]) == ("rank", 1, 7, "memory")
    assert rec["lost_steps"] == 0  # zero 0: the holder's own snapshot of step 6 is rank 1's replica, never in flight
    assert sum(rec["phases_s"].values()) == pytest.approx(rec["mttr_s"], abs=0.01)  # phases are rounded to ms
    assert rec["mttr_s"] > 0
    # the survivors left their collectives with the dead peer at once, not after the 60 s collective timeout
    assert rec["phases_s"]["detect"] + rec["phases_s"]["survivors"] < 5, rec["phases_s"]
    after = {r["rank"]: r for r in recovered.layout["ranks"]}
    new = {int(rank) for rank, before in rec["identities_before"].items()
           if (after[int(rank)]["pid"], after[int(rank)]["actor_id"]) != (before["pid"], before["actor_id"])}
    # only rank 1 is new: its direct peers (0 and 3) fail at once and leave their gloo groups, which frees rank 2
    # (blocked only on survivors) at once too, so no survivor is restarted for being blocked past the grace
    assert new == {1}, (new, rec["phases_s"])
    assert "-spare" in get_actor(after[1]["actor_id"]).name  # the warm spare, started after step 1, took over


def test_a_step_that_raises_or_runs_out_of_memory_replaces_the_rank(straight, ray_cluster, token_data, heldout_data,
                                                                  tmp_path):
    """A live rank's exception (here injected inside the step) is a failure to recover from, not the job's end:
    the rank is replaced (its peer, whose collective broke with it, is kept) and nothing is lost: step 4, which
    failed, is scored once it is trained again, and every held-out loss equals the uninterrupted run's."""
    recovered = run(token_data, tmp_path / "raised", parallel={"dp": 2}, **ON_DEFAULTS,
                    eval=held_out(heldout_data),
                    faults=[{"kind": "raise_error", "rank": 0, "at_step": 4}, {"kind": "oom", "rank": 1, "at_step": 9}])
    assert recovered.losses == straight.losses
    assert {e["step"]: e["loss"] for e in recovered.eval_losses} == straight.eval_losses
    assert list(straight.eval_losses) == [4, 8, 12, 16, 20]
    assert [(r["kind"], r["rank"], r["lost_steps"]) for r in recovered.recoveries] == [("error", 0, 0), ("oom", 1, 0)]
    first, second = recovered.recoveries
    assert first["identities_before"][1]["pid"] == second["identities_before"][1]["pid"]  # rank 1 was kept


def test_fault_injected_through_the_control_api_into_a_live_job(ray_cluster, token_data, tmp_path, straights):
    straight = ran(straights, "dp2-30")
    spec = tiny_spec(token_data, tmp_path / "live", parallel={"dp": 2}, train={"steps": 30},
                     checkpoint={"memory_every": 1}, fault_tolerance=FAST_DETECTION, control={"allow_faults": True})
    client, finish = start_live(spec)
    with pytest.raises(ValueError, match="rank 9 is not a rank of this 2-rank job"):
        client.inject_fault("kill_rank", 9)
    at_step = client.inject_fault("kill_rank", 1)
    result = finish()
    assert [(r["kind"], r["rank"], r["at_step"]) for r in result.recoveries] == [("rank", 1, at_step)]
    assert result.losses == straight.losses


def test_request_scale_resizes_data_parallelism_and_stays_on_the_reference_curve(ray_cluster, token_data, tmp_path):
    steps = 16
    expected = reference_losses(tiny_spec(token_data, tmp_path / "ref", train={"steps": steps}), steps)
    spec = tiny_spec(token_data, tmp_path / "elastic", parallel={"dp": 4}, train={"steps": steps, "microbatches": 1},
                     checkpoint={"memory_every": 1})
    client, finish = start_live(spec)
    with pytest.raises(ValueError, match="train.global_batch_size"):
        client.request_scale(3)  # 8 sequences do not split over 3 data ranks
    client.request_scale(2)
    result = finish()
    assert result.layout["dp"] == 2 and result.layout["world_size"] == 2
    assert result.layout["microbatches"] == 2  # the global batch stays 8 through gradient accumulation
    assert result.losses == pytest.approx(expected, rel=1e-4)


def test_kill_rank_in_a_context_parallel_layout_recovers_bit_identical(ray_cluster, token_data, tmp_path, straights):
    """cp=2 (ring attention, each rank half of every sequence): the dead rank's replacement restores its
    snapshot and both ranks go on exactly as an uninterrupted run (issue 16)."""
    straight = ran(straights, "cp2")
    recovered = run(token_data, tmp_path / "killed", **CP, faults=[{"kind": "kill_rank", "rank": 1, "at_step": 4}])
    assert recovered.losses == straight.losses and recovered.grad_norms == straight.grad_norms
    assert [(r["kind"], r["rank"], r["source"]) for r in recovered.recoveries] == [("rank", 1, "memory")]


def test_kill_rank_in_an_expert_parallel_layout_recovers_bit_identical(ray_cluster, token_data, tmp_path, straights):
    """dp=4 x ep=2 (issue 15): ranks 0 and 2 hold one half of the experts, 1 and 3 the other; the dead rank's
    replacement restores the snapshot its replica peer holding the same experts kept, and the run goes on
    exactly as an uninterrupted one."""
    straight = ran(straights, "ep")
    recovered = run(token_data, tmp_path / "killed", **EP, faults=[{"kind": "kill_rank", "rank": 1, "at_step": 3}])
    assert recovered.losses == straight.losses and recovered.grad_norms == straight.grad_norms
    assert [(r["kind"], r["rank"], r["source"]) for r in recovered.recoveries] == [("rank", 1, "memory")]


@pytest.mark.parametrize("kind", list(COMPRESSED))
def test_kill_rank_under_compression_recovers_bit_identical_with_its_error_feedback(kind, ray_cluster, token_data,
                                                                                   tmp_path, straights):
    """Each rank's error feedback (PowerSGD's, with its warm-started Q; 1-bit Adam's) differs from its peer's and
    lives outside the model and optimizer: the dead rank's replacement takes its own back from the snapshot its
    holder kept (its peer's own snapshot, the mirror that plain all-reduce uses, would hand it the peer's
    feedback), so the run after the kill, past the warm-up, equals the uninterrupted run bit for bit."""
    straight = ran(straights, kind)
    recovered = run(token_data, tmp_path / "killed", **COMPRESSED[kind], **ON_DEFAULTS,
                    faults=[{"kind": "kill_rank", "rank": 1, "at_step": 5}])
    assert recovered.losses == straight.losses and recovered.grad_norms == straight.grad_norms
    (rec,) = recovered.recoveries
    assert (rec["kind"], rec["rank"], rec["source"]) == ("rank", 1, "memory")
    # replicas ship, so the default cadence is every 10 steps: the kill before step 5 rolls back to step 0's
    assert rec["lost_steps"] == 4


class SendSignal(JobObserver):
    """Sends rank ``rank``'s process ``sig`` once step ``at`` is shown: SIGSTOP freezes it (no error, no exit; its
    peers wait for it), SIGTERM is a preemption notice (a spot reclaim's, a Kubernetes eviction's)."""

    def __init__(self, job: TrainingJob, rank: int, at: int, sig: signal.Signals):
        self.job, self.rank, self.at, self.sig = job, rank, at, sig

    def on_step(self, report) -> None:
        if report.record["step"] == self.at:
            self.at = -1  # once: a rollback shows the step again
            os.kill(self.job.layout.ranks[self.rank].pid, self.sig)


def test_a_frozen_rank_is_found_by_the_progress_deadline_diagnosed_and_replaced_bit_identical(
        ray_cluster, token_data, tmp_path, straights):
    """On the job file's timeouts (heartbeat 120 s, collectives 60 s) a frozen rank was found after a minute or two:
    the progress deadline (three typical steps, at least 5 s) finds it; every rank's stacks, the frozen one's
    too, are written into the run dir and named in the recovery; the rank that does not answer is killed and
    replaced, and training goes on from the snapshot, nothing lost (issue 51). The detection is checked against
    the rule the controller promises, from the run's own records: the deadline is ``hang_steps`` times the median
    of the steps before it in ``steps.jsonl`` (at least ``hang_floor_s``), the silence when it was found is that
    deadline plus at most one poll, and the diagnosis took at most the ranks' answer and stack waits."""
    spec = _spec(token_data, tmp_path, parallel={"dp": 2},
                 fault_tolerance={"heartbeat_timeout_s": 120.0, "collective_timeout_s": 60.0})
    job = TrainingJob(spec, progress=False)
    job.observers.add(SendSignal(job, rank=1, at=6, sig=signal.SIGSTOP))
    result = job.run()
    (rec,) = result.recoveries
    assert (rec["kind"], rec["rank"], rec["source"], rec["lost_steps"]) == ("hang", 1, "memory", 0)
    detection, ft = rec["detection"], spec.fault_tolerance
    before = first_records(spec.resolved_run_dir() / "steps.jsonl", rec["at_step"] - 1)
    median = statistics.median(r["step_s"] for r in before[-20:])
    assert detection["median_step_s"] == pytest.approx(median, abs=1e-4)
    deadline = min(ft.heartbeat_timeout_s, max(ft.hang_floor_s, ft.hang_steps * median))
    assert detection["deadline_s"] == pytest.approx(deadline, abs=1e-3)
    poll = min(job._poll_s, deadline / 4)  # the controller looks once per poll of rank 0's desk
    assert deadline <= detection["silent_s"] <= deadline + poll + CALL_SLACK_S, detection
    assert detection["diagnose_s"] <= WHERE_S + STACKS_S, detection  # the frozen rank is not waited for
    assert rec["phases_s"]["detect"] >= detection["silent_s"] + detection["diagnose_s"] - 0.01
    stacks = Path(rec["stacks"])
    assert stacks.parent == spec.resolved_run_dir() / "hangs" and not (stacks / "missing.txt").exists()
    for rank in (0, 1):  # each rank's loop thread, where it was: the frozen one and its peer waiting for it
        text = (stacks / f"rank{rank}.txt").read_text()
        assert "in run_window" in text and "loop.py" in text, text
    assert result.losses == ran(straights, "dp2").losses  # bit-identical to the uninterrupted run
    print(f"frozen rank: median step {median:.3f} s, deadline {deadline:.2f} s, found after {detection['silent_s']:.2f}"
          f" s, stacks and kill {detection['diagnose_s']:.2f} s, detect phase {rec['phases_s']['detect']:.2f} s")


def first_records(path: Path, last_step: int) -> list[dict]:
    """The ``steps.jsonl`` records of steps 1..``last_step`` as first written (before any rollback re-ran them)."""
    first: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        first.setdefault(record["step"], record)
    return [first[s] for s in range(1, last_step + 1)]


def test_a_preemption_notice_saves_the_step_and_the_rank_is_replaced_bit_identical(ray_cluster, token_data, tmp_path,
                                                                                   straights):
    """SIGTERM to a rank's process: the rank reports it with its step, every rank saves that step (checkpoints are
    every 50 steps here, so any before the last is the notice's), the rank is replaced, nothing is lost and the
    run equals the uninterrupted one bit for bit (issue 51)."""
    spec = _spec(token_data, tmp_path, parallel={"dp": 2})
    job = TrainingJob(spec, progress=False)
    job.observers.add(SendSignal(job, rank=1, at=6, sig=signal.SIGTERM))
    result = job.run()
    (rec,) = result.recoveries
    assert (rec["kind"], rec["rank"], rec["lost_steps"]) == ("preempt", 1, 0)
    saved = rec["at_step"] - 1
    assert 6 <= saved < STEPS and job.ckpt.complete_steps() == [saved, STEPS]
    assert result.losses == ran(straights, "dp2").losses
