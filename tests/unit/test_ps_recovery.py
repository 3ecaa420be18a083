"""Losing an asp/ssp worker, no Ray: the clock keeper hands the lost step back and ends the old generation's loops
and rounds, the staleness bound holds while the worker is gone, a survivor stage whose step failed gives it up, a
shard acknowledges a retried push without applying it twice and a call (or the controller's ping) Ray answers
"unavailable" is made again;
losing both holders of a key names what is lost."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from orchestrator.runtime import ps_shards
from orchestrator.runtime.ps_shards import lost_updates, ping_shards
from parameter_server import client, clocks, optimizers
from parameter_server.client import _RayFuture
from parameter_server.clocks import LOST, ClockKeeper
from parameter_server.errors import ShardDown
from parameter_server.ring import HashRing, chunk_key
from parameter_server.shard import PSShard
from tests.support.jobs import wait_for
from workers.parallel.ps_sync import ROUND_POLL_S, PSSync

ADAMW = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.95], "momentum": 0.0}


def _in_thread(call) -> tuple[threading.Thread, list]:
    out: list = []

    def run():
        try:
            out.append(call())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_hand_over_returns_the_lost_step_and_the_bound_holds_until_the_replacement_rejoins():
    keeper = ClockKeeper(replicas=2, staleness=1, steps=3)  # budget: 6 worker steps
    assert keeper.enter(1)  # worker 1 takes a step and dies in it
    for _ in range(2):  # worker 0 runs ahead up to the bound (worker 1 still at clock 0)
        assert keeper.enter(0)
        keeper.tick(0)
    blocked, entered = _in_thread(lambda: keeper.enter(0))
    waiting, ended = _in_thread(lambda: keeper.wait_completed(2 * 2))
    blocked.join(0.2)
    assert blocked.is_alive()  # 2 ahead of the lost worker with staleness 1: held back
    kept = keeper.hand_over([1])
    blocked.join(5), waiting.join(5)
    assert entered == [False]  # the old generation's loop ends
    assert isinstance(ended[0], RuntimeError) and LOST in str(ended[0])  # and its round is abandoned
    assert {k: kept[k] for k in ("clocks", "started", "completed", "generation")} == {
        "clocks": [2, 0], "started": 2, "completed": 2, "generation": 1}  # the lost step is back
    keeper.resume()
    gen = kept["generation"]
    assert keeper.enter(1, gen)  # the replacement redoes clock 0
    keeper.tick(1)
    for _ in range(2):
        for worker in (0, 1):
            if keeper.enter(worker, gen):
                keeper.tick(worker)
    assert keeper.state()["completed"] == 6 and not keeper.enter(0, gen)  # the whole budget, no step twice


def test_a_retried_push_is_acknowledged_and_not_applied_twice():
    """A worker died pushing clock 0: one holder applied it, the other did not; its replacement pushes clock 0
    again, which the first acknowledges unchanged and the second applies, so both count one push from it."""
    holders = [PSShard(i, "ssp", ADAMW, 2, [0.1]) for i in range(2)]
    for shard in holders:
        shard.register({"w#0": torch.ones(4)})
    holders[0].push(1, 0, {"w#0": torch.full((4,), 2.0)})
    before = holders[0].state()["params"]["w#0"]
    for shard in holders:
        shard.push(1, 0, {"w#0": torch.full((4,), 3.0)})
    assert torch.equal(holders[0].state()["params"]["w#0"], before)
    assert not torch.equal(holders[1].state()["params"]["w#0"], torch.ones(4))
    assert [s.clock()["applied_from"] for s in holders] == [[0, 1], [0, 1]]
    holders[1].push(1, 1, {"w#0": torch.full((4,), 3.0)})
    assert holders[1].clock()["applied_from"] == [0, 2]


def test_a_pipelined_replica_handed_over_redoes_its_step_in_every_stage():
    """Two replicas of two stages (workers 0, 1: stage 0; 2, 3: stage 1). Replica 1's stage 1 finished its step
    and its stage 0 died in it: both stages go back to clock 0, and a late tick of the old generation is not
    counted, so the replacement and its surviving peer redo the step together."""
    keeper = ClockKeeper(replicas=2, staleness=None, steps=2, stages=2)
    assert keeper.enter(1) and keeper.enter(3)
    keeper.tick(3, 2.5, generation=0)
    kept = keeper.hand_over([1])
    assert {k: kept[k] for k in ("clocks", "started", "completed", "generation")} == {
        "clocks": [0, 0, 0, 0], "started": 0, "completed": 0, "generation": 1}
    keeper.tick(1, None, generation=0)  # the dead stage's step, finishing late: handed back already
    assert keeper.state()["clocks"] == [0, 0, 0, 0]
    keeper.resume()
    assert keeper.enter(1, 1) and keeper.enter(3, 1)
    keeper.tick(1, None, generation=1), keeper.tick(3, 2.0, generation=1)
    assert keeper.state()["clocks"] == [0, 1, 0, 1] and keeper.wait_completed(1, 3, generation=1) == 1


def test_a_hand_over_does_not_wait_for_a_survivor_stage_held_by_the_lost_replica(monkeypatch):
    """SSP bound 0, two replicas of two stages (workers 0, 1: stage 0; 2, 3: stage 1). Replica 1 finished step 0
    and its stage 0 took step 1; its stage 1 waits for stage 1's slowest, replica 0's, which dies in step 0. The
    hand-over must not wait for that step (it cannot finish without the lost replica): the waiting stage leaves
    the generation, and replica 1 is set back to the step both its stages completed, to redo step 1."""
    monkeypatch.setattr(clocks, "WAIT_S", 5.0)  # a keeper that waits for the held step fails fast instead of hanging
    keeper = ClockKeeper(replicas=2, staleness=0, steps=4, stages=2)
    assert keeper.enter(0) and keeper.enter(1) and keeper.enter(3)
    keeper.tick(0), keeper.tick(1), keeper.tick(3, 2.5)
    assert keeper.enter(1)  # replica 1, step 1: granted to both its stages
    held: list[bool] = []
    stage1 = threading.Thread(target=lambda: held.append(keeper.enter(3)))
    stage1.start()
    stage1.join(timeout=0.3)
    assert stage1.is_alive()  # stage 1's slowest (worker 2) is at 0
    kept = keeper.hand_over([0])
    stage1.join(timeout=5)
    assert held == [False]
    assert {k: kept[k] for k in ("clocks", "started", "completed")} == {
        "clocks": [0, 1, 0, 1], "started": 1, "completed": 1}


def test_a_stage_arriving_after_the_hand_over_abandons_the_step_its_peer_took(monkeypatch):
    """Replica 1's stage 0 took step 0; before its stage 1 asks for it, replica 0 is lost. Stage 1, still of the
    ended generation, must not begin the step, and the hand-over must not wait for it: replica 1 goes back to 0."""
    monkeypatch.setattr(clocks, "WAIT_S", 5.0)
    keeper = ClockKeeper(replicas=2, staleness=0, steps=4, stages=2)
    assert keeper.enter(1)
    handing, kept = _in_thread(lambda: keeper.hand_over([0]))
    wait_for(lambda: keeper.generation == 1, 60, "the hand-over to begin", poll_s=0.001)
    assert keeper.enter(3, generation=0) is False
    handing.join(timeout=5)
    assert {k: kept[0][k] for k in ("clocks", "started", "completed")} == {
        "clocks": [0, 0, 0, 0], "started": 0, "completed": 0}


def test_a_survivor_stage_whose_step_failed_gives_it_up_and_the_hand_over_does_not_wait_for_it(monkeypatch):
    """The state a kill_rank drill under ssp with pp=2 once hung in: replica 1 is lost; replica 0's stage 0 ticked
    its step 2, but its stage 1's step failed (a shard call broke as the other rank died), so that stage will never
    tick it. Without ``give_up`` the hand-over waits for it until the keeper's deadline; with it, the hand-over
    returns and replica 0 is set back to redo step 2 with both stages (the shards acknowledge the repeated push
    of stage 0 without applying it twice)."""
    monkeypatch.setattr(clocks, "WAIT_S", 2.0)
    keeper = ClockKeeper(replicas=2, staleness=1, steps=10, stages=2)  # workers 0, 1: stage 0; 2, 3: stage 1
    for _ in range(2):
        assert keeper.enter(0) and keeper.enter(2) and keeper.enter(1) and keeper.enter(3)
        keeper.tick(0), keeper.tick(2), keeper.tick(1), keeper.tick(3)
    assert keeper.enter(0) and keeper.enter(2)  # replica 0's step 2, both stages
    keeper.tick(0)
    with pytest.raises(TimeoutError, match="the survivors' steps in flight"):
        keeper.hand_over([1])  # worker 2 neither ticks nor gives up: nothing ends the wait
    keeper.give_up(2)
    kept = keeper.hand_over([1])
    assert {k: kept[k] for k in ("clocks", "started", "completed")} == {
        "clocks": [2, 2, 2, 2], "started": 4, "completed": 4}
    keeper.give_up(0)  # a worker with no step in flight gives up nothing
    assert keeper.abandoned == set()


def test_a_shard_call_ray_says_is_unavailable_is_made_again_and_only_a_dead_shard_is_down(monkeypatch):
    """Ray's ActorUnavailableError (a dropped connection to a live shard) once made a worker mark both holders of
    a key down for good. The call is made again (shard calls are idempotent); a shard still unavailable after the
    retries, or one Ray says died, is ``ShardDown``."""
    import ray

    answers: list = []
    monkeypatch.setattr(client, "UNAVAILABLE_RETRY_S", (0.0, 0.0, 0.0))
    monkeypatch.setattr(ray, "get", lambda ref: ref() if callable(ref) else ref)

    def unavailable():
        raise ray.exceptions.ActorUnavailableError("Socket closed", None)

    def died():
        raise ray.exceptions.ActorDiedError()

    def submit():  # each try takes the next answer
        return answers.pop(0)

    answers[:] = [unavailable, unavailable, 7]
    assert _RayFuture(submit).result() == 7 and answers == []
    answers[:] = [unavailable] * 4
    with pytest.raises(ShardDown, match="Socket closed"):
        _RayFuture(submit).result()
    answers[:] = [died, 7]
    with pytest.raises(ShardDown, match="died"):
        _RayFuture(submit).result()
    assert answers == [7]  # a dead shard is not asked again


def test_a_round_ends_with_its_free_running_loops_own_error_as_soon_as_there_is_one(monkeypatch):
    """A worker's loop that failed on its own (no holder of a key left, a bug) may leave its round waiting for a
    step that never completes; the round raises that error at its next look instead of the keeper's answer."""
    import ray

    looks: list = []
    worker = SimpleNamespace(error=None)

    def wait(refs, timeout=None):  # the keeper's answer never comes
        looks.append(timeout)
        if len(looks) == 3:  # the loop fails while the round waits
            worker.error = ShardDown("every holder of 'stage0.w#0' ([0, 1]) is down")
        return [], refs

    monkeypatch.setattr(ray, "wait", wait)
    with pytest.raises(ShardDown, match="every holder"):
        PSSync._wait_round(worker, "ref")
    assert looks == [ROUND_POLL_S] * 3
    monkeypatch.setattr(ray, "wait", lambda refs, timeout=None: (refs, []))
    monkeypatch.setattr(ray, "get", lambda ref: 4)
    assert PSSync._wait_round(SimpleNamespace(error=None), "ref") == 4



def test_the_controller_restarts_only_shards_that_stay_unavailable_or_died(monkeypatch):
    """The controller's ping once took a dropped connection to a live shard for its death and restarted it.
    Shard 0 answers, shard 1 is unavailable once then answers, shard 2 stays unavailable, shard 3 died and
    shard 4 does not answer in time: only 2, 3 and 4 are dead, and only 1 and 2 are asked again."""
    import ray

    def unavailable():
        raise ray.exceptions.ActorUnavailableError("Socket closed", None)

    def died():
        raise ray.exceptions.ActorDiedError()

    answers = {0: [True], 1: [unavailable, True], 2: [unavailable] * 4, 3: [died], 4: ["late"]}
    asked: list = []

    def handle(i):
        def remote():
            asked.append(i)
            return answers[i].pop(0)
        return SimpleNamespace(ping=SimpleNamespace(remote=remote))

    monkeypatch.setattr(ps_shards, "UNAVAILABLE_RETRY_S", (0.0, 0.0, 0.0))
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: ([r for r in refs if r != "late"], []))
    monkeypatch.setattr(ray, "get", lambda ref: ref() if callable(ref) else ref)
    assert ping_shards([handle(i) for i in range(5)]) == [True, True, False, False, False]
    assert sorted(asked) == [0, 1, 1, 2, 2, 2, 2, 3, 4]

@pytest.mark.parametrize("consistency", ["asp", "ssp"])
def test_restore_lets_the_workers_start_again_after_a_hand_over(consistency):
    keeper = ClockKeeper(replicas=2, staleness=None if consistency == "asp" else 1, steps=2)
    keeper.hand_over([0])
    keeper.restore([1, 1], 2)  # a recovery that loads a checkpoint instead (recovery: restart_all)
    assert keeper.enter(0, keeper.state()["generation"])


def test_losing_both_holders_of_keys_names_them_and_the_steps_lost():
    """Three shards, two gone: exactly the chunks whose two holders were those two are named, with the steps since
    the newest disk snapshot that holds each; one gone loses nothing (its successor or primary has every key)."""
    ring = HashRing(3, 16)
    layout = {"stage0.w": {"shape": [40, 10], "dtype": "float32"}}
    keys = [chunk_key("stage0.w", i) for i in range(40)]
    both = [k for k in keys if set(ring.holders(k)) == {0, 2}]
    assert both and len(both) < len(keys)
    message = lost_updates(ring, 10, layout, [0, 2], {0: 4, 2: None}, step=7)
    assert "shards 0, 2 are all gone" in message and f"{len(both)} chunks ({', '.join(both[:8])}" in message
    assert "lose the updates of steps 5 to 7 (their newest disk snapshot is of step 4)" in message
    assert "fix: resume from the latest checkpoint" in message
    assert "steps 1 to 7 (no disk snapshot holds them)" in lost_updates(ring, 10, layout, [0, 2], {}, step=7)
    assert lost_updates(ring, 10, layout, [1], {}, step=7) == ""


class _Planted:
    """What someone who may write the run directory leaves as a shard snapshot: unpickling it runs ``touch``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (type(self.marker).touch, (self.marker,))


def test_a_snapshot_is_read_as_tensors_only_so_a_planted_one_runs_no_code(tmp_path):
    """Before: the controller read each dead shard's snapshot with ``weights_only=False``, so a pickle planted in
    ``run_dir/ps`` ran its code in the controller when two shards were lost. A real snapshot still gives its step."""
    (tmp_path / "ps").mkdir()
    shard = PSShard(0, "bsp", ADAMW, 1, [1e-2] * 4)
    shard.register({"w#0": torch.ones(3)}, {"w": {"shape": [3], "dtype": "float32"}})
    optimizers.step(shard.opts["w#0"], torch.ones(3), 1e-2)  # AdamW's state too: a snapshot's whole content
    shard.version = 3
    shard.save(str(tmp_path / "ps" / "shard-0.pt"))
    marker = tmp_path / "ran"
    torch.save({"version": _Planted(marker)}, tmp_path / "ps" / "shard-1.pt")
    shards = ps_shards.PSShards.__new__(ps_shards.PSShards)
    shards.run_dir, shards.keeper = tmp_path, None
    shards.spec = SimpleNamespace(parallel=SimpleNamespace(dp=1, pp=1))
    assert shards._snapshot_versions([0, 1, 2]) == {0: 3, 1: None, 2: None}
    assert not marker.exists()
