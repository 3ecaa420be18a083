"""Checksum manifests, the soak schedule and the straggler detector on their own (no Ray)."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from orchestrator import JobSpec
from orchestrator.checkpoints.checksums import MANIFEST, problem
from orchestrator.checkpoints.directory import CheckpointDir
from orchestrator.errors import SpecError
from orchestrator.faults.disk import corrupt_newest
from orchestrator.faults.schedule import FaultSchedule
from orchestrator.faults.soak import RepeatingFault
from orchestrator.recovery.stragglers import StragglerDetector
from orchestrator.spec import FaultSpec


def fake_save(ckpt: CheckpointDir, step: int) -> None:
    """What DCP leaves: shard files, then ``.metadata``; the controller seals it afterwards."""
    path = ckpt.path_for(step)
    path.mkdir(parents=True)
    for rank in range(2):
        (path / f"__{rank}_0.distcp").write_bytes(bytes(random.Random(step * 10 + rank).randbytes(4096)))
    (path / ".metadata").write_bytes(b"meta")


def test_manifest_catches_flipped_bytes_truncation_and_unsealed_saves(tmp_path):
    ckpt = CheckpointDir(tmp_path, keep=5)
    for step in (3, 6):
        fake_save(ckpt, step)
        ckpt.seal(step)
    fake_save(ckpt, 9)  # DCP finished but the controller never sealed it: not complete
    assert ckpt.complete_steps() == [3, 6]
    assert problem(ckpt.path_for(9)).startswith(f"no {MANIFEST}")
    assert problem(ckpt.path_for(6)) is None
    flipped = corrupt_newest(ckpt)
    assert flipped.parent == ckpt.path_for(6) and flipped.stat().st_size == 4096  # same size: only the CRC tells
    assert problem(ckpt.path_for(6)) == f"{flipped.name} fails its CRC-32 check"
    (ckpt.path_for(3) / "__1_0.distcp").write_bytes(b"short")
    assert problem(ckpt.path_for(3)) == "__1_0.distcp has 5 bytes, the manifest says 4096"


def test_latest_verified_moves_corrupt_checkpoints_aside_and_returns_the_previous(tmp_path):
    seen = []
    ckpt = CheckpointDir(tmp_path, keep=5, on_skip=seen.append)
    for step in (3, 6, 9):
        fake_save(ckpt, step)
        ckpt.seal(step)
    corrupt_newest(ckpt)
    (ckpt.path_for(6) / ".metadata").unlink()
    assert ckpt.latest_verified("resume") == ckpt.path_for(3)
    assert [(s["step"], s["found_by"]) for s in ckpt.skipped] == [(9, "resume"), (6, "resume")]
    assert seen == ckpt.skipped
    assert ckpt.complete_steps() == [3]  # moved to step-N.corrupt, never picked again
    assert (tmp_path / "step-00000009.corrupt").is_dir()


def test_steps_past_eight_digits_are_found_ordered_and_pruned(tmp_path):
    """`step-%08d` writes step 10**8 with nine digits: such a save is complete, newest and resumable, and retention
    still takes the older eight-digit ones (the names once matched exactly eight, and hid them)."""
    ckpt = CheckpointDir(tmp_path, keep=2)
    for step in (99_999_999, 100_000_000, 100_000_001):
        fake_save(ckpt, step)
        ckpt.seal(step)
        ckpt.prune(step)
    assert ckpt.complete_steps() == [100_000_000, 100_000_001]
    assert ckpt.latest_verified("resume") == tmp_path / "step-100000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-100000000", "step-100000001"]


def test_repeating_fault_is_deterministic_by_seed():
    def firings(seed):
        now = [0.0]
        soak = RepeatingFault({"kind": "kill_rank", "rank": "random", "every_s": 60.0, "jitter_s": 10.0,
                               "seed": seed, "factor": 3.0}, clock=lambda: now[0])
        out = []
        for step in range(1, 2000):
            now[0] = step * 0.5  # a step every half second
            fired = soak.due(step, world_size=8)
            if fired is not None:
                out.append((fired["at_step"], fired["rank"]))
        return out

    first = firings(7)
    assert first == firings(7) and first != firings(8)
    # the n-th firing lands n * every_s ± jitter_s after the first step (a step is issued every 0.5 s): the
    # jitter never adds up, so 999 s hold 16 firings whatever the draws
    times = [(step - 1) * 0.5 for step, _ in first]
    assert len(first) == 16 and all(abs(t - 60 * n) <= 10.5 for n, t in enumerate(times, start=1)), times
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(set(gaps)) > 1 and all(gap > 0 for gap in gaps)
    assert len({rank for _, rank in first}) > 1 and all(0 <= rank < 8 for _, rank in first)


def test_repeating_fault_waits_for_training_to_pass_its_previous_step():
    now = [0.0]
    soak = RepeatingFault({"kind": "kill_rank", "rank": 1, "every_s": 10.0, "jitter_s": 0.0, "seed": 0,
                           "factor": 3.0}, clock=lambda: now[0])
    assert soak.due(1, 2) is None
    now[0] = 10.0
    assert soak.due(8, 2)["at_step"] == 8
    now[0] = 30.0  # a slow recovery rolled back to step 5: steps 6..8 are redone before the next firing
    assert [soak.due(step, 2) for step in (6, 7, 8)] == [None] * 3
    assert soak.due(9, 2) == {"kind": "kill_rank", "rank": 1, "at_step": 9, "factor": 3.0}


def test_corrupt_checkpoint_is_the_controllers_and_other_faults_the_ranks(token_data):
    spec = JobSpec.from_dict({"data": {"path": str(token_data)}, "parallel": {"dp": 2}, "train": {"steps": 10},
                              "faults": [{"kind": "corrupt_checkpoint", "at_step": 4},
                                         {"kind": "kill_rank", "rank": 0, "at_step": 4}]})
    schedule = FaultSchedule(spec.faults)
    assert [f["kind"] for f in schedule.for_step(4, 2).values()] == ["kill_rank"]
    assert [f["kind"] for f in schedule.for_controller(4)] == ["corrupt_checkpoint"]
    assert schedule.for_controller(4) == []  # one-shot


@pytest.mark.parametrize("fault, field, value, fix", [
    ({"kind": "kill_rank"}, "faults.0.at_step", "None", "set at_step: N"),
    ({"kind": "kill_rank", "at_step": 3, "every_s": 60}, "faults.0.every_s", "60.0", "not both"),
    ({"kind": "kill_rank", "every_s": 60, "jitter_s": 30}, "faults.0.jitter_s", "30.0", "set jitter_s below 30.0"),
    ({"kind": "kill_rank", "at_step": 3, "rank": "random"}, "faults.0.rank", "'random'", "set every_s"),
    ({"kind": "kill_rank", "at_step": 3, "jitter_s": 5}, "faults.0.jitter_s", "5.0", "remove jitter_s"),
    ({"kind": "slow_rank", "every_s": 60}, "faults.0.every_s", "60.0", "use at_step for slow_rank"),
    ({"kind": "kill_rank", "every_s": 60, "rank": "any"}, "faults.0.rank", "'any'", "or `random` with every_s"),
])
def test_soak_fault_errors_name_field_value_and_fix(token_data, fault, field, value, fix):
    with pytest.raises(SpecError) as err:
        JobSpec.from_dict({"data": {"path": str(token_data)}, "parallel": {"dp": 2}, "faults": [fault]})
    assert f"`{field}`: value {value}" in str(err.value) and fix in str(err.value)


def test_straggler_is_reported_after_consecutive_slow_steps_and_cleared_after_as_many_normal():
    detector = StragglerDetector(ratio=1 / 0.7, steps=3)
    timeline = [1.0, 3.0, 1.0, 3.0, 3.0, 3.0, 3.0, 1.0, 3.0, 1.0, 1.0, 1.0]  # rank 2's step time; the others take 1 s
    flagged = []
    for step, slow in enumerate(timeline, start=1):
        ratios = detector.observe(step, {0: 1.0, 1: 1.0, 2: slow, 3: 1.0})
        flagged.append(detector.flagged())
    assert ratios[2] == 1.0 and ratios[0] == 1.0
    assert flagged[:5] == [set()] * 5 and flagged[5:11] == [{2}] * 6 and flagged[11] == set()
    assert detector.episodes == [{"rank": 2, "since_step": 4, "until_step": 9, "max_ratio": 3.0}]


def test_one_slow_rank_of_two_stands_out_against_the_other():
    ratios = StragglerDetector(ratio=1 / 0.7, steps=3).observe(1, {0: 1.0, 1: 3.0})
    assert ratios == {0: pytest.approx(1 / 3), 1: 3.0}


def test_each_ratio_is_over_the_median_of_the_other_ranks_as_statistics_works_it_out():
    """observe takes each rank's median of the others from one sorted list (linear in ranks, not quadratic)."""
    rng = random.Random(0)
    for n in range(2, 30):
        times = {r: rng.choice([1.0, 1.5, rng.uniform(0.5, 3.0)]) for r in range(n)}
        ratios = StragglerDetector(ratio=2.0, steps=3).observe(1, times)
        for rank, seconds in times.items():
            others = statistics.median(t for r, t in times.items() if r != rank)
            assert ratios[rank] == pytest.approx(seconds / others, rel=1e-12)


def test_shard_kill_and_a_rank_fault_at_the_same_step_both_happen():
    """kill_ps_shard is the controller's: it must not share the rank-keyed dict with rank 0's own fault."""
    faults = [FaultSpec(kind="slow_rank", rank=0, at_step=2, factor=2.0),
              FaultSpec(kind="kill_ps_shard", shard=1, at_step=3),
              FaultSpec(kind="kill_rank", rank=1, at_step=3)]
    schedule = FaultSchedule(faults)
    ranks = schedule.for_step(3, 2)
    assert {r: f["kind"] for r, f in ranks.items()} == {0: "slow_rank", 1: "kill_rank"}
    assert [(f["kind"], f["shard"]) for f in schedule.for_controller(3)] == [("kill_ps_shard", 1)]


def test_a_parameter_server_call_past_its_deadline_fails_saying_what_was_waited_for(monkeypatch):
    import ray

    from orchestrator.runtime.ps_shards import answer

    waited = []

    def times_out(refs, timeout):
        waited.append(timeout)
        raise ray.exceptions.GetTimeoutError("timed out")

    monkeypatch.setattr(ray, "get", times_out)
    with pytest.raises(RuntimeError, match=r"parameter server: shard 1 \(its state, to resync shard 0\) did not "
                                           r"answer within 600 s \(5 x fault_tolerance.heartbeat_timeout_s\); fix: "):
        answer(["ref"], "shard 1 (its state, to resync shard 0)", 600.0)
    assert waited == [600.0]  # never an unbounded wait
