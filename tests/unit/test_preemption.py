"""Preemption notices (issue 51): a rank's process told to go (SIGTERM) reports it with its step; rank 0 ends the
window there, every rank saves that step, and the controller replaces the rank with nothing lost. Ray-free: the
fake group's ranks run the real loop (``RankLoop``) and controller."""

from __future__ import annotations

from orchestrator.runtime import controller
from tests.support.controller_jobs import make_job
from tests.support.fake_group import FakeRuntime
from workers.loop.desk import Desk
from workers.loop.loop import RankLoop
from workers.loop.plan import CheckpointPlan, Request, Window
from workers.loop.summary import StepSummary
from workers.loop.tree import LocalTransport, TreeExchange
from workers.protocol import StepResult, StepTimes


def _recovery(result) -> tuple:
    (rec,) = result.recoveries
    return rec["kind"], rec["rank"], rec["at_step"], rec["lost_steps"], rec["source"]


def test_a_notice_saves_its_step_as_a_checkpoint_and_the_rank_is_replaced_with_nothing_lost(tmp_path):
    runtime = FakeRuntime(preempt={5: 1})
    job = make_job(tmp_path, runtime=runtime, checkpoint={"every": 50, "memory_every": 3})
    result = job.run()
    assert _recovery(result) == ("preempt", 1, 6, 0, "disk")  # step 5's checkpoint is newer than step 3's snapshot
    assert job.ckpt.complete_steps() == [5, 10]  # the notice's step, then the run's last (every: 50)
    assert runtime.groups[0].preempted_ranks == [1] and runtime.groups[0].replaced == [{1}]
    assert result.status == "finished" and result.steps == 10
    assert result.losses == make_job(tmp_path / "straight").run().losses


def test_without_checkpoints_the_notice_step_is_snapshot(tmp_path):
    runtime = FakeRuntime(preempt={7: 0})
    result = make_job(tmp_path, runtime=runtime, checkpoint={"every": 0, "memory_every": 5}).run()
    assert _recovery(result) == ("preempt", 0, 8, 0, "memory")
    assert 7 in runtime.groups[0].snapshots


def test_a_draining_node_preempts_its_ranks_which_are_saved_and_move_to_another_node(tmp_path, monkeypatch):
    """Ray drains rank 1's node during step 5 (``ray drain-node``, a spot reclaim): the controller hears it at its
    next check, rank 0 ends the window at the next boundary with that step checkpointed, and rank 1 is replaced
    off the node (``leave``), once: the moved rank is not preempted again. Nothing lost."""
    monkeypatch.setattr(controller, "DRAIN_CHECK_S", 0.0)  # the fake's steps take microseconds, not seconds
    runtime = FakeRuntime()
    runtime.script = {5: lambda: runtime.draining_nodes.update(node1=30.0)}
    job = make_job(tmp_path, runtime=runtime, checkpoint={"every": 50, "memory_every": 4})
    result = job.run()
    (rec,) = result.recoveries  # step 6's checkpoint is newer than step 4's snapshot
    assert (rec["kind"], rec["rank"], rec["node"], rec["lost_steps"], rec["source"]) == ("drain", 1, "node1", 0, "disk")
    saved = rec["at_step"] - 1
    assert 5 <= saved < 10 and job.ckpt.complete_steps() == [saved, 10]  # the notice's step, then the last
    group = runtime.groups[0]
    assert group.preempted_ranks == [1] and group.left == [("node1",)] and group.replaced == [{1}]
    assert [r["node_id"] for r in result.layout["ranks"]] == ["node0", "node1b"]  # rank 1 lives elsewhere now
    assert result.losses == make_job(tmp_path / "straight").run().losses


def test_a_drained_node_without_ranks_of_the_job_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(controller, "DRAIN_CHECK_S", 0.0)
    runtime = FakeRuntime()
    runtime.draining_nodes["node7"] = None
    result = make_job(tmp_path, runtime=runtime).run()
    assert result.recoveries == [] and result.steps == 10


def test_a_drained_rank_posted_by_the_controller_ends_the_window_preempted_with_its_step_saved():
    desk = Desk()
    desk.post(Request(preempted=(1,)))
    desk.post(Request(preempted=(0,)))
    steps = _Steps(told=99)
    plan = CheckpointPlan(every=50, last_step=10, path_pattern="ckpt/{step}")
    end = RankLoop(steps, TreeExchange(0, 1, LocalTransport()), desk).run(Window(until=10, checkpoint=plan))
    assert (end.step, end.reason, end.ranks) == (1, "preempt", (0, 1)) and steps.saved == [("ckpt/1", False)]


def result(rank: int, step: int) -> StepResult:
    return StepResult(rank=rank, step=step, loss=1.0, grad_norm=0.5, lr=1e-3, tokens=8, applied=True,
                      time_s=StepTimes(compute=0.1, step=0.1), peak_memory_bytes=100, current_memory_bytes=50,
                      replicated_step=step - 1)


class _Steps:
    """A one-rank stepper whose process had a notice before ``told``; records what it saved."""

    def __init__(self, told: int):
        self.step, self.told, self.saved = 0, told, []

    def run_step(self, faults, detail):
        self.step += 1
        return StepSummary.of(result(0, self.step), detail, preempted=self.step >= self.told)

    def skip_batch(self): ...
    def snapshot(self, keep_from): ...
    def save_state(self): return None
    def finish_save(self): return None

    def save(self, path, async_save, dir_mode):
        self.saved.append((path, async_save))
        return None


def test_a_stop_asked_at_the_same_step_wins_and_the_notice_is_not_a_recovery():
    desk = Desk()
    desk.post(Request(stop="stop"))
    steps = _Steps(told=1)
    plan = CheckpointPlan(every=50, async_save=True, last_step=10, path_pattern="ckpt/{step}")
    end = RankLoop(steps, TreeExchange(0, 1, LocalTransport()), desk).run(Window(until=10, checkpoint=plan))
    assert (end.step, end.reason, end.ranks) == (1, "stop", ())
    steps = _Steps(told=2)
    end = RankLoop(steps, TreeExchange(0, 1, LocalTransport()), Desk()).run(Window(until=10, checkpoint=plan))
    assert (end.step, end.reason, end.ranks) == (2, "preempt", (0,))
    assert steps.saved == [("ckpt/2", False)]  # whole before the window ends: the rank goes right after


def test_a_drain_while_a_replica_is_rebuilt_names_the_drained_rank_and_node_by_the_grid(tmp_path, monkeypatch):
    """Under ``recovery: keep_training`` the loop numbers the ranks that step 0.. (rank 1 failed: grid ranks 0, 2, 3
    step as 0, 1, 2). Grid rank 3's node is drained meanwhile: the recovery names rank 3 and ``node3``, not the
    loop's rank 2 (``node2``, whose rank was never told to go)."""
    from tests.support.controller_jobs import kill

    monkeypatch.setattr(controller, "DRAIN_CHECK_S", 0.0)
    runtime = FakeRuntime(ready_after=50)
    runtime.script = {6: lambda: runtime.draining_nodes.update(node3=30.0)}
    job = make_job(tmp_path, [kill(1, 4)], runtime=runtime, parallel={"dp": 4},
                   fault_tolerance={"recovery": "keep_training"}, checkpoint={"every": 50, "memory_every": 1})
    result = job.run()
    drained = [r for r in result.recoveries if r["kind"] == "drain"]
    assert [(r["rank"], r["node"]) for r in drained] == [(3, "node3")]
    group = runtime.groups[0]
    assert group.preempted_ranks == [3] and group.left == [("node3",)]
    assert result.status == "finished" and result.steps == 10
