"""The controller's pure parts on their own: the state machine's table, the policies' decisions, the records."""

from __future__ import annotations

import pytest

from orchestrator.records import RecoveryRecord, ResizeRecord
from orchestrator.recovery.policy import (
    NAN_WITHOUT_SNAPSHOT,
    Action,
    Decision,
    Failure,
    RecoveryPolicy,
    RestartWindow,
    ScalingPolicy,
    ranks_that_failed,
)
from orchestrator.recovery.snapshot_target import replica_holders
from orchestrator.runtime.controller import layout_of
from orchestrator.runtime.group import StepFailed
from orchestrator.runtime.states import TRANSITIONS, IllegalTransition, JobState, JobStateMachine
from tests.support.fake_group import FakeElastic
from tests.support.jobs import tiny_spec
from workers.diagnostics.faults import RankStepError
from workers.protocol import RankInfo

S = JobState


@pytest.fixture
def spec(tmp_path):
    return tiny_spec(tmp_path / "data", tmp_path, parallel={"dp": 2}, fault_tolerance={"max_restarts": 2})


def dead(*ranks: int, at_step: int = 4) -> Failure:
    return Failure("rank", frozenset(ranks), at_step, ", ".join(f"rank {r} died" for r in ranks))


def test_ended_states_have_no_way_out():
    assert all(not TRANSITIONS[s] for s in S if s.terminal)
    machine = JobStateMachine()
    machine.to(S.RUNNING)
    machine.to(S.FINISHED)
    with pytest.raises(IllegalTransition, match="job state finished -> running is not a legal transition"):
        machine.to(S.RUNNING)


def test_starting_cannot_jump_to_recovering():
    with pytest.raises(IllegalTransition, match="fix: from starting the job may go to"):
        JobStateMachine().to(S.RECOVERING)


def test_fail_keeps_an_ended_job_as_it_ended():
    machine = JobStateMachine()
    machine.to(S.RUNNING)
    machine.to(S.FINISHED)
    machine.fail()
    assert machine.state is S.FINISHED


def test_recovering_and_resizing_read_as_running_to_users():
    machine = JobStateMachine()
    machine.to(S.RUNNING)
    machine.to(S.RECOVERING)
    assert machine.public == "running"
    machine.request_stop()
    assert machine.public == "stopping" and machine.state is S.RECOVERING
    machine.resume()
    assert machine.state is S.STOPPING


def test_a_stop_before_the_first_step_starts_the_run_stopping():
    machine = JobStateMachine()
    machine.request_stop()
    assert machine.public == "starting"
    machine.resume()
    assert machine.visited == [S.STARTING, S.STOPPING]


def test_a_dead_rank_within_budget_is_replaced(spec):
    assert RecoveryPolicy(spec).on_failure(dead(1), restarts=1).action is Action.REPLACE


def test_over_budget_gives_up_naming_the_setting(spec):
    decision = RecoveryPolicy(spec).on_failure(dead(0, 1), restarts=3)
    assert decision.action is Action.GIVE_UP
    assert decision.message == ("rank 0 died, rank 1 died at step 4: 3 rank restarts within 600 s exceed "
                                "fault_tolerance.max_restarts=2 (per fault_tolerance.restart_window_s=600): the run "
                                "is failing faster than it recovers; look at the failing rank's log "
                                "(`ray logs actor`), or raise max_restarts")


def test_the_restart_budget_is_a_rate_over_a_sliding_window():
    now = [0.0]
    window = RestartWindow(600, clock=lambda: now[0])
    spent = []
    for minute in range(12):  # a rank lost every minute: never more than 10 within any 600 s
        now[0] = 60.0 * minute
        spent.append(window.spend(1))
    assert spent == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 10]
    now[0] += 1.0  # a crash loop: a node of 4 ranks lost and lost again a second later
    assert window.spend(4) == 14 and window.spend(4) == 18
    now[0] += 600.0  # all of it older than the window
    assert window.spend(2) == 2


def test_restart_all_mode_restarts_everything(tmp_path):
    spec = tiny_spec(tmp_path / "data", tmp_path, fault_tolerance={"recovery": "restart_all"})
    assert RecoveryPolicy(spec).on_failure(dead(0), restarts=1).action is Action.RESTART_ALL


def test_a_nan_step_rolls_back_and_placement_decides_shrink(spec):
    policy = RecoveryPolicy(spec)
    assert policy.on_failure(Failure("nan_loss", frozenset(), 6, "nan_loss"), restarts=0).action is Action.ROLL_BACK
    assert policy.on_placement(True).action is Action.ROLL_BACK
    assert policy.on_placement(False).action is Action.SHRINK


@pytest.mark.parametrize(("usable", "replaced", "expected"), [
    (True, True, (Action.ROLL_BACK, "memory")), (True, False, (Action.ROLL_BACK, "memory")),
    (False, True, (Action.ROLL_BACK, "disk")), (False, False, (Action.GIVE_UP, None)),
])
def test_roll_back_prefers_memory_then_disk_and_never_disk_for_nan(spec, usable, replaced, expected):
    decision = RecoveryPolicy(spec).roll_back(usable, replaced)
    assert (decision.action, decision.source) == expected
    if decision.action is Action.GIVE_UP:
        assert decision.message == NAN_WITHOUT_SNAPSHOT


@pytest.mark.parametrize("replaced", [True, False])
def test_roll_back_takes_a_checkpoint_newer_than_the_snapshot(spec, replaced):
    """It loses fewer steps; for a NaN step too (the checkpoint's step was finite)."""
    decision = RecoveryPolicy(spec).roll_back(True, replaced, newer_on_disk=True)
    assert (decision.action, decision.source) == (Action.ROLL_BACK, "disk")


def test_a_scale_request_beats_growing_back_and_retargets_it(spec):
    elastic = FakeElastic(spec)
    elastic.grow_to = 2
    scaling = ScalingPolicy(elastic)
    smaller = spec.model_copy(update={"parallel": spec.parallel.model_copy(update={"dp": 1})})
    scaling.request(smaller)
    assert scaling.next_resize(spec, False) == (smaller, "request") and elastic.target_dp == 1
    grown, reason = scaling.next_resize(spec, False)
    assert reason == "grow" and grown.parallel.dp == 2
    assert scaling.next_resize(spec, False) is None


def test_records_keep_the_summary_keys():
    rec = RecoveryRecord("rank", 1, 4, 0, "memory", {}, 2, 2)
    assert list(rec.to_dict()) == ["kind", "rank", "at_step", "lost_steps", "source", "identities_before",
                                   "dp_from", "dp_to"]
    assert list(rec.completed(1.5, {"detect": 0.1}).to_dict())[-2:] == ["mttr_s", "phases_s"]
    resize = ResizeRecord("shrink", 5, 2, 1, 4, "memory", 0.25)
    assert resize.to_dict() == {"reason": "shrink", "at_step": 5, "dp_from": 2, "dp_to": 1, "microbatches": 4,
                                "source": "memory", "seconds": 0.25, "lost_steps": 0}


def test_the_layout_keeps_the_summary_keys_and_each_ranks_info(spec):
    info = RankInfo(rank=0, coords={"dp": 0, "pp": 0, "tp": 0}, stages=[0], device="cpu", device_name="cpu",
                    pid=7, node_id="n", actor_id="a")
    layout = layout_of(spec, [info, info]).to_dict()
    assert list(layout) == ["dp", "pp", "tp", "zero", "pp_schedule", "virtual_stages", "microbatches",
                            "world_size", "ranks", "pp_split", "node_order"]
    assert layout["dp"] == 2 and layout["ranks"][0] == info.to_dict()
    assert layout["pp_split"] == list(spec.stage_split)


def test_a_raised_step_is_classified_and_only_ranks_that_failed_on_their_own_are_replaced():
    oom = RankStepError.of(MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    io = RankStepError.of(OSError(28, "No space left on device"))
    broke = RankStepError.of(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    assert (oom.kind, io.kind, broke.kind) == ("oom", "error", "peer_lost")
    assert ranks_that_failed({0: broke, 2: oom, 3: io}) == {
        2: "ran out of memory (MemoryError: CUDA out of memory. Tried to allocate 2.00 GiB)",
        3: "raised (OSError: [Errno 28] No space left on device)"}
    assert set(ranks_that_failed({0: broke, 1: broke})) == {0, 1}  # none can be told apart: all replaced
    assert StepFailed(ranks_that_failed({2: oom})).kind == "oom"


def test_a_nan_is_run_again_then_skipped_or_stopped(spec):
    policy = RecoveryPolicy(spec)  # nan_retries 1, on_repeated_nan skip_batch by default
    assert policy.on_nan(6, 1).action is Action.ROLL_BACK
    assert policy.on_nan(6, 2) == Decision(Action.SKIP_BATCH, step=6)


def test_replica_holders_go_to_another_node_whenever_one_can_hold_them(tmp_path):
    spec = tiny_spec(tmp_path / "data", tmp_path, parallel={"dp": 3, "pp": 2}, train={"global_batch_size": 12})
    grid = spec.parallel.grid  # rank = dp * 2 + pp
    one_node = {r: "A" for r in grid.ranks()}
    assert replica_holders(grid, one_node) == {r: grid.replica_peer(r) for r in grid.ranks()}
    packed = {0: "A", 1: "A", 2: "A", 3: "A", 4: "B", 5: "B"}  # dp replicas 0 and 1 share node A
    holders = replica_holders(grid, packed)
    assert holders == {0: 4, 1: 5, 2: 4, 3: 5, 4: 0, 5: 1}  # same pp position, another dp replica, other node
    assert all(packed[holders[r]] != packed[r] for r in grid.ranks())
