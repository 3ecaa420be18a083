"""`fault_tolerance.recovery: keep_training` on Ray: dp=4, rank 1 (replica 1) killed; the other replicas train on
while it is rebuilt, it rejoins from a live peer, and the run stays on the uninterrupted run's loss curve."""

from __future__ import annotations

import json

from orchestrator import JobSpec, TrainingJob
from tests.support.jobs import tiny_spec
from tests.support.same_state import same_state

STEPS = 40
# rank 0 steps 10x slower (every rank waits for it in the all-reduce), so the run outlasts the replacement's start
# (seconds: a process importing torch) and the replacement rejoins mid-run: 0.05 s steps ended before it was up
SLOW = {"kind": "slow_rank", "rank": 0, "at_step": 1, "factor": 10.0}
KILLED_AT = 4
# hang_floor_s: the slowed rank's 0.5 s steps, stretched by a loaded machine, passed the 5 s floor and were
# taken for a hang (a second recovery); this test is about keep_training, the hang tests are elsewhere
SECTIONS = {"parallel": {"dp": 4}, "train": {"steps": STEPS}, "checkpoint": {"memory_every": 1},
            "fault_tolerance": {"recovery": "keep_training", "warm_spares": True, "heartbeat_timeout_s": 20,
                                "collective_timeout_s": 5, "hang_floor_s": 20}}


def _run(token_data, tmp_path, faults, monkeypatch=None):
    """The job; with ``monkeypatch``, also every rank's snapshot of the last step, taken as the grid stops."""
    spec = tiny_spec(token_data, tmp_path, **SECTIONS)
    job = TrainingJob(JobSpec.from_dict({**spec.to_dict(), "faults": faults}), progress=False)
    finals, builds = [], []
    if monkeypatch is not None:
        stop = type(job)._stop

        def keep_finals(self):
            if self.group is not None:
                finals.extend(self.group.call("kept_snapshot", self.step))
                builds.extend(self.group.call("trainer_builds"))
            stop(self)

        monkeypatch.setattr(type(job), "_stop", keep_finals)
    job.trainer_builds = builds  # every rank's count of trainers its process built, read as the grid stops
    return job, job.run(), finals


def test_replicas_0_2_3_train_on_while_replica_1_is_rebuilt(ray_cluster, token_data, tmp_path, monkeypatch):
    _, straight, _ = _run(token_data, tmp_path / "straight", [])
    job, result, finals = _run(token_data, tmp_path / "killed",
                               [{"kind": "kill_rank", "rank": 1, "at_step": KILLED_AT}, SLOW], monkeypatch)
    assert result.status == "finished" and result.steps == STEPS
    (rec,) = result.recoveries
    assert (rec["kind"], rec["rank"], rec["at_step"], rec["lost_steps"]) == ("rank", 1, KILLED_AT, 0)
    # replicas 0, 2 and 3 completed steps while replica 1 was rebuilt; it rejoined before the end
    assert rec["degraded_steps"] and rec["degraded_steps"][0] == KILLED_AT and rec["rejoined_at_step"] < STEPS
    lines = [json.loads(line) for line in (job.run_dir / "steps.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if line.get("replicas") == 3] == rec["degraded_steps"]
    assert rec["skipped_sequences"] == len(rec["degraded_steps"]) * 8 // 4
    # every replica ends with the same weights and optimizer state, bit for bit
    assert len(finals) == 4 and all(same_state(finals[0], snap) for snap in finals[1:])
    # neither re-formation rebuilt a survivor: each process built its trainer once (rank 1's replacement too, alone
    # while the others stepped: the rejoin kept it, as it kept theirs)
    assert job.trainer_builds == [(1, False), (1, True), (1, False), (1, False)]
    # the failed replica's share of the degraded steps was skipped: off the uninterrupted curve, within 1% of it
    # (the curve: five-step means; one step's loss over 8 sequences, or over the 6 a degraded step trains, moves
    # by more than that from batch to batch)
    assert result.losses != straight.losses
    ours, theirs = _curve(result.losses), _curve(straight.losses)
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))
    assert worst < 0.01, f"largest relative difference of the curves {worst:.4f}: {ours} vs {theirs}"


def _curve(losses: list[float], steps: int = 5) -> list[float]:
    """The loss curve: the mean of each ``steps`` consecutive steps' losses."""
    return [sum(losses[i - steps:i]) / steps for i in range(steps, len(losses) + 1)]
