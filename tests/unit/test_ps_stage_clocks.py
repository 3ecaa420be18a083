"""asp/ssp clocks per pipeline stage, no Ray: the ``ClockKeeper`` and ``PSShard`` called in this process.

Workers are ``stage * replicas + replica``. The keeper hands a replica's step to all its stages at once (a stage is
never refused a step its peer stage runs, even with the budget spent), bounds each stage by its own slowest worker,
and tells every stage which of its steps a controller step holds; a shard counts each stage's pushes apart (its
learning-rate step and the reads' staleness), and an empty push (an fp16 overflow's skip) passes a clock and
changes nothing.
"""

from __future__ import annotations

import threading

import pytest
import torch

from parameter_server.clocks import ClockKeeper
from parameter_server.shard import PSShard

SGD = {"name": "sgd", "lr": 1.0, "weight_decay": 0.0, "betas": [0.9, 0.95], "momentum": 0.0}


def _step(keeper: ClockKeeper, *workers: int) -> None:
    for w in workers:
        assert keeper.enter(w)
    for w in workers:
        keeper.tick(w)


def _blocked(fn, *args) -> threading.Thread:
    """Run ``fn`` on a thread and check that it is still waiting a moment later."""
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    thread.join(0.2)
    assert thread.is_alive(), f"{fn.__name__}{args} did not wait"
    return thread


def _counts(keeper: ClockKeeper) -> dict:
    """The keeper's clocks and step counts (its state less the recovery fields, generation and losses)."""
    return {k: v for k, v in keeper.state().items() if k in ("clocks", "started", "completed")}


def test_a_replica_step_is_granted_to_all_its_stages_from_one_budget():
    keeper = ClockKeeper(replicas=2, staleness=None, steps=1, stages=2)  # workers 0, 1: stage 0; 2, 3: stage 1
    _step(keeper, 0, 2)  # replica 0's first step, both stages: one unit of the budget of 2
    assert _counts(keeper) == {"clocks": [1, 0, 1, 0], "started": 1, "completed": 1}
    assert keeper.enter(0)  # replica 0 runs ahead and takes the last unit ...
    assert not keeper.enter(1) and not keeper.enter(3)  # ... so replica 1 is refused, in both stages alike
    assert keeper.enter(2)  # while replica 0's other stage still gets the step its peer started
    keeper.tick(2)
    assert keeper.state()["completed"] == 1  # a replica step completes once every stage ticked it
    keeper.tick(0)
    assert _counts(keeper) == {"clocks": [2, 0, 2, 0], "started": 2, "completed": 2}
    assert keeper.wait_completed(2, worker=2) == 2 and keeper.wait_completed(2, worker=1) == 0


def test_each_stage_is_bounded_by_its_own_slowest_worker():
    keeper = ClockKeeper(replicas=2, staleness=1, steps=10, stages=2)
    _step(keeper, 0, 2)
    _step(keeper, 0, 2)  # replica 0 at clock 2 in both stages, replica 1 at 0: ahead by the bound and one step
    _step(keeper, 1)  # replica 1's stage 0 finishes its step, its stage 1 (worker 3) is still in it
    assert keeper.enter(3)
    assert keeper.enter(0)  # stage 0's slowest is at 1: replica 0 may start its clock-2 step there
    waiting = _blocked(keeper.enter, 2)  # granted by its peer, but stage 1's slowest (worker 3) is still at 0
    keeper.tick(3)
    waiting.join(5)
    assert not waiting.is_alive()
    assert keeper.state()["clocks"] == [2, 1, 2, 1]


def test_completed_steps_are_split_by_replica_in_completion_order():
    """A controller step holds the first ``step * replicas`` replica steps to complete; each stage of a replica is
    told how many of them were its replica's, so both report the same steps (and a restore keeps counting)."""
    keeper = ClockKeeper(replicas=2, staleness=None, steps=3, stages=2)
    _step(keeper, 0, 2)
    _step(keeper, 0, 2)  # replica 0 completes two steps before replica 1 completes one
    _step(keeper, 1, 3)
    assert [keeper.wait_completed(2, w) for w in range(4)] == [2, 0, 2, 0]
    assert [keeper.wait_completed(3, w) for w in range(4)] == [2, 1, 2, 1]
    state = keeper.state()
    again = ClockKeeper(replicas=2, staleness=None, steps=3, stages=2)
    again.restore(state["clocks"], state["completed"])
    _step(again, 1, 3)
    assert [again.wait_completed(4, w) for w in range(4)] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="restore of 2 clocks, but the job has 4 workers"):
        again.restore([1, 1], 2)


def test_pause_waits_for_a_step_one_stage_has_not_started_yet():
    keeper = ClockKeeper(replicas=1, staleness=0, steps=5, stages=2)
    assert keeper.enter(0)  # stage 0 took the step; stage 1 has not asked yet
    pausing = _blocked(keeper.pause)
    assert keeper.enter(1)  # paused, yet the step granted to its peer is given (else pause never returns)
    keeper.tick(0)
    keeper.tick(1)
    pausing.join(5)
    assert not pausing.is_alive() and keeper.state()["completed"] == 1
    _blocked(keeper.enter, 0)  # no new steps while paused
    keeper.resume()


def test_shard_counts_each_stage_on_its_own():
    """Two replicas of two stages (workers 0, 1 push stage 0's key; 2, 3 stage 1's). Stage 1's pushes do not move
    stage 0 to its next learning rate, a read's staleness is measured against the reader's own stage, and an empty
    push (a replica whose fp16 step overflowed) passes its clock without touching a weight."""
    shard = PSShard(0, "ssp", SGD, workers=2, lrs=[1.0, 0.5, 0.25], stages=2)
    shard.register({"stage0.w#0": torch.zeros(2), "stage1.w#0": torch.zeros(2)})
    for clock, worker in ((0, 2), (0, 3), (1, 2), (1, 3)):  # stage 1 runs two steps: each push of ones at half weight
        shard.push(worker, clock, {"stage1.w#0": torch.ones(2)} if worker == 2 else {})
    assert torch.equal(shard.params["stage1.w#0"], torch.tensor([-0.75, -0.75]))  # lr 1.0, then 0.5
    shard.push(0, 0, {"stage0.w#0": torch.ones(2)})  # stage 0's first push: still its step 0's rate
    assert torch.equal(shard.params["stage0.w#0"], torch.tensor([-0.5, -0.5]))
    shard.push(1, 0, {})  # replica 1 overflowed in stage 0: its clock passes, no weight moves
    assert torch.equal(shard.params["stage0.w#0"], torch.tensor([-0.5, -0.5]))
    assert shard.clock()["applied_from"] == [1, 1, 2, 2]
    shard.pull(["stage0.w#0"], worker=0, clock=1)
    shard.pull(["stage1.w#0"], worker=3, clock=2)
    assert [(r["stage"], r["clock"] - r["min_applied"]) for r in shard.read_log()] == [(0, 0), (1, 0)]
    with pytest.raises(ValueError, match="workers are 0 to 3"):
        shard.push(4, 0, {})
