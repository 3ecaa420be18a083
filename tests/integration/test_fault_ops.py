"""Corrupt checkpoints are skipped, stragglers reported, and the restart-all baseline loses nothing either."""

from __future__ import annotations

import pytest

from orchestrator import JobSpec, TrainingJob
from orchestrator.checkpoints.directory import CheckpointDir
from orchestrator.faults.disk import corrupt_newest
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped

FAST_DETECTION = {"heartbeat_timeout_s": 20, "collective_timeout_s": 5}
DISK_ONLY = {"every": 3, "keep": 3, "memory_every": 0, "async": False}  # recoveries must come from disk


@pytest.fixture(scope="module")
def straights(token_data, tmp_path_factory):
    """The uninterrupted dp=2 runs (15 and 10 steps) the tests compare with, in one spawn of the Ray-free harness
    (the same Trainer gives a Ray job's bits)."""
    tmp = tmp_path_factory.mktemp("straights")
    return run_grouped({f"{steps} steps": tiny_spec(token_data, tmp / str(steps), parallel={"dp": 2},
                                                    train={"steps": steps}) for steps in (15, 10)})


def run(spec, faults=(), resume=False):
    return TrainingJob(JobSpec.from_dict({**spec.to_dict(), "faults": list(faults)}), resume=resume,
                       progress=False).run()


def test_corrupt_checkpoint_is_skipped_by_disk_recovery_and_by_resume(ray_cluster, token_data, tmp_path, straights):
    straight = ran(straights, "15 steps")
    spec = tiny_spec(token_data, tmp_path / "faulty", parallel={"dp": 2}, train={"steps": 12},
                     checkpoint=DISK_ONLY, fault_tolerance=FAST_DETECTION)
    # before step 8: step-6 (the newest) is corrupted, then rank 1 dies; recovery must fall back to step-3
    recovered = run(spec, faults=[{"kind": "corrupt_checkpoint", "at_step": 8},
                                  {"kind": "kill_rank", "rank": 1, "at_step": 8}])
    assert recovered.losses == straight.losses[:12]  # bit-identical
    (skipped,) = recovered.corrupt_checkpoints
    assert (skipped["step"], skipped["found_by"]) == (6, "recovery") and "CRC-32" in skipped["problem"]
    (rec,) = recovered.recoveries
    assert (rec["kind"], rec["source"], rec["lost_steps"]) == ("rank", "disk", 4)  # back from step 7 to step 3

    ckpt = CheckpointDir(spec.checkpoint.resolved_dir(spec.resolved_run_dir()), 3)
    assert ckpt.complete_steps() == [6, 9, 12]
    corrupt_newest(ckpt)  # step-12
    resumed = run(spec.with_overrides(["train.steps=15"]), resume=True)
    assert resumed.resumed_from == str(ckpt.path_for(9))
    assert [(s["step"], s["found_by"]) for s in resumed.corrupt_checkpoints] == [(12, "resume")]
    assert resumed.losses == straight.losses[9:]


def test_slow_rank_is_reported_as_a_straggler(ray_cluster, token_data, tmp_path):
    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 2}, train={"steps": 10})
    result = run(spec, faults=[{"kind": "slow_rank", "rank": 1, "at_step": 1, "factor": 3}])
    (episode,) = result.stragglers
    assert episode["rank"] == 1 and episode["until_step"] is None
    assert episode["max_ratio"] > spec.fault_tolerance.straggler_ratio
    assert 0 < result.goodput <= 1


def test_restart_all_baseline_restarts_every_rank_from_disk(ray_cluster, token_data, tmp_path, straights):
    straight = ran(straights, "10 steps")
    spec = tiny_spec(token_data, tmp_path / "all", parallel={"dp": 2}, train={"steps": 10}, checkpoint=DISK_ONLY,
                     fault_tolerance={**FAST_DETECTION, "recovery": "restart_all"})
    result = run(spec, faults=[{"kind": "kill_rank", "rank": 1, "at_step": 5}])
    assert result.losses == straight.losses
    (rec,) = result.recoveries
    assert (rec["source"], rec["lost_steps"]) == ("disk", 1)
    after = {r["rank"]: r["pid"] for r in result.layout["ranks"]}
    assert all(after[int(rank)] != before["pid"] for rank, before in rec["identities_before"].items())
