"""The ranks' own loop without Ray or torch: the exchange tree, the in-band summary, the boundary's decisions."""

from __future__ import annotations

import pickle
import queue
import statistics
import threading
from dataclasses import replace

import pytest

from orchestrator.observability.run_records import step_record
from workers.loop.desk import Desk
from workers.loop.loop import RankLoop
from workers.loop.plan import CheckpointPlan, Progress, Request, SaveRecord, StepRecord, Window, WindowEnd
from workers.loop.summary import SaveState, StepSummary
from workers.loop.tree import LocalTransport, TreeExchange, children, parent
from workers.protocol import StepResult, StepTimes


def result(rank: int, step: int = 1, loss: float | None = 1.0, seconds: float = 0.1, **extras) -> StepResult:
    return StepResult(rank=rank, step=step, loss=loss, grad_norm=0.5, lr=1e-3, tokens=8, applied=True,
                      time_s=StepTimes(compute=seconds, step=seconds), peak_memory_bytes=100 + rank,
                      current_memory_bytes=50, replicated_step=step - 1, **extras)


@pytest.mark.parametrize("size, fan_in", [(1, 8), (9, 8), (100, 8), (37, 3), (16384, 8)])
def test_every_participant_but_the_root_has_one_parent_that_lists_it(size, fan_in):
    listed = [c for p in range(size) for c in children(p, size, fan_in)]
    assert sorted(listed) == list(range(1, size)) and parent(0, fan_in) is None
    assert all(me in children(parent(me, fan_in), size, fan_in) for me in range(1, size))
    depth = max(_depth(me, fan_in) for me in range(size))
    assert fan_in ** (depth - 1) < size or depth == 0  # log_fan_in(size) levels, no more


def _depth(me: int, fan_in: int) -> int:
    return 0 if me == 0 else 1 + _depth(parent(me, fan_in), fan_in)


class QueueTransport:
    """Participants on threads, a queue per (sender, receiver): the tree's messages without a network."""

    def __init__(self, me: int, boxes: dict):
        self.me, self.boxes = me, boxes

    def send(self, obj, to: int) -> None:
        self.boxes[(self.me, to)].put(pickle.dumps(obj))  # as on the wire: no object shared between ranks

    def recv(self, source: int):
        return pickle.loads(self.boxes[(source, self.me)].get(timeout=30))


def exchange_on_threads(partials: list, fan_in: int, decide) -> list:
    """Each participant's view of one exchange of ``partials`` (one per participant, on its own thread)."""
    size = len(partials)
    boxes = {(a, b): queue.Queue() for a in range(size) for b in range(size) if a != b}
    seen: list = [None] * size

    def run(me: int) -> None:
        seen[me] = TreeExchange(me, size, QueueTransport(me, boxes), fan_in).exchange(partials[me], decide)

    threads = [threading.Thread(target=run, args=(me,)) for me in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return seen


def test_the_tree_gives_the_root_every_ranks_summary_and_every_rank_its_decision():
    results = [result(r, loss=1.0 / (r + 3), seconds=0.1 + r / 1000, comm_bytes={"dp": r}) for r in range(37)]
    merged = []
    seen = exchange_on_threads([StepSummary.of(r) for r in results], fan_in=3,
                               decide=lambda whole: merged.append(whole) or ("go", whole.ranks))
    assert seen == [("go", 37)] * 37
    (whole,) = merged
    folded = StepSummary.of_all(results)  # the same as one fold over the ranks, whatever the tree
    assert replace(whole, phases={}) == replace(folded, phases={})
    assert whole.phases == {p: pytest.approx(v, rel=1e-12) for p, v in folded.phases.items()}  # float sums
    record = step_record(whole, 1.0, 8, 0.0, 0.0)
    assert record["loss"] == statistics.fmean(1.0 / (r + 3) for r in range(37))  # bit for bit, as always
    assert record["comm_bytes"] == {"dp": 36} and sorted(map(int, record["phases"])) == list(range(37))


def test_a_summary_without_detail_is_the_same_size_for_8_ranks_and_for_4096():
    def summary(ranks: int) -> StepSummary:
        return StepSummary.of_all([result(r, seconds=0.1 + (r == 5)) for r in range(ranks)], detail=False)

    small, large = summary(8), summary(4096)
    assert len(pickle.dumps(large)) - len(pickle.dumps(small)) < 64  # a few digits more, never a rank's worth
    record = step_record(large, 1.0, 8, 0.0, 0.0)
    assert "phases" not in record and "memory" not in record
    assert record["ranks"]["count"] == 4096 and record["ranks"]["slowest"][0] == [1.1, 5]
    assert record["ranks"]["peak_bytes"] == [100 + 4095, 4095]


class Steps:
    """A participant stepping two ranks on its own: records what the loop made it do."""

    def __init__(self, loss=lambda step: 1.0 / step):
        self.step, self.loss, self.done = 0, loss, []
        self.pending: SaveState | None = None

    def run_step(self, faults: dict, detail: bool) -> StepSummary:
        self.step += 1
        self.done.append(("step", self.step, dict(faults)))
        return StepSummary.of_all([result(r, self.step, self.loss(self.step)) for r in (0, 1)], detail, self.pending)

    def skip_batch(self) -> None:
        self.done.append(("skip", self.step + 1))

    def snapshot(self, keep_from: int) -> None:
        self.done.append(("snapshot", self.step, keep_from))

    def save(self, path: str, async_save: bool, dir_mode) -> str | None:
        self.done.append(("save", path, async_save))
        self.pending = SaveState(self.step, done=True) if async_save else None
        return None

    def save_state(self) -> SaveState | None:
        return self.pending

    def finish_save(self) -> SaveState | None:
        pending, self.pending = self.pending, None
        return pending


class ReadDesk(Desk):
    """A desk whose items count as handed over as they are put (the tests read them all at the end)."""

    def put(self, item) -> None:
        super().put(item)
        self._acked += 1


def run(window: Window, steps: Steps, posts: dict[int, Request] | None = None) -> tuple[WindowEnd, list]:
    """One window on a one-participant group; ``posts``: step -> a request posted while that step runs."""
    desk = ReadDesk(1)
    original = steps.run_step

    def posting(faults, detail):
        for request in [(posts or {}).pop(steps.step + 1, None)]:
            if request is not None:
                desk.post(request)
        return original(faults, detail)

    steps.run_step = posting
    end = RankLoop(steps, TreeExchange(0, 1, LocalTransport()), desk).run(window)
    items, _ = desk.items(0, 0)
    return end, items


def test_a_stop_posted_during_a_step_ends_the_window_at_its_boundary_with_a_save():
    steps = Steps()
    plan = CheckpointPlan(every=100, last_step=10, path_pattern="ckpt/step-{step:08d}")
    end, items = run(Window(until=10, checkpoint=plan), steps, posts={4: Request(stop="stop")})
    assert end == WindowEnd(4, "stop") and steps.step == 4
    assert [i.step for i in items if isinstance(i, StepRecord)] == [1, 2, 3, 4]
    assert ("save", "ckpt/step-00000004", False) in steps.done  # a stop saves, and synchronously
    assert isinstance(items[-1], WindowEnd) and any(isinstance(i, SaveRecord) and i.step == 4 for i in items)


def test_planned_faults_skips_and_live_faults_reach_their_steps():
    steps = Steps()
    slow = {"kind": "slow_rank", "rank": 1, "at_step": 3, "factor": 2.0}
    kill = {"kind": "kill_rank", "rank": 0, "at_step": 5}
    live = {"kind": "raise_error", "rank": 1}
    window = Window(until=6, faults={5: {0: kill}}, slow={1: slow}, skips={2: 2})
    end, _ = run(window, steps, posts={3: Request(faults=(live,))})
    faults = {step: f for kind, step, *f in steps.done if kind == "step" for f in f}
    assert faults[2] == {} and faults[3] == {1: slow} and faults[5] == {0: kill, 1: slow}
    assert faults[4] == {1: {**live, "at_step": 4}}  # posted during step 3: the next step's
    assert steps.done.count(("skip", 2)) == 2 and end == WindowEnd(6, "until")


def test_a_nan_loss_ends_the_window_before_its_record_snapshot_or_save():
    steps = Steps(loss=lambda step: float("nan") if step == 3 else 1.0)
    plan = CheckpointPlan(every=1, last_step=10, path_pattern="c/{step}")
    end, items = run(Window(until=10, snapshot_every=1, checkpoint=plan), steps)
    assert end == WindowEnd(2, "nan_loss")
    assert [i.step for i in items if isinstance(i, StepRecord)] == [1, 2]
    assert ("snapshot", 3, 2) not in steps.done and ("save", "c/3", False) not in steps.done


def test_an_async_save_is_reported_started_then_written_once_every_rank_has_it():
    steps = Steps()
    plan = CheckpointPlan(every=2, async_save=True, last_step=4, path_pattern="c/{step}")
    _, items = run(Window(until=4, checkpoint=plan), steps)
    saves = [(i.step, i.done) for i in items if isinstance(i, SaveRecord)]
    assert saves == [(2, False), (2, True), (4, False), (4, True)]  # the last one finished before the window ends
    assert [i.phase for i in items if isinstance(i, Progress)] == ["window", "save", "save", "wait"]


def test_a_step_that_stalled_is_recorded_and_its_excess_is_not_goodput(tmp_path):
    from orchestrator.observability.observers import Observers
    from orchestrator.observability.step_accounting import StepAccounting
    from orchestrator.recovery.stragglers import StragglerDetector
    from tests.support.jobs import tiny_spec

    spec = tiny_spec(tmp_path / "data", tmp_path)
    acct = StepAccounting(spec, "cpu", Observers(), StragglerDetector(1.5, 3), [])
    records = [acct.step(StepSummary.of_all([result(0, step)]), 0.1, 0.0, 1).record for step in range(1, 7)]
    stalled = acct.step(StepSummary.of_all([result(0, 7)]), 30.0, 0.0, 1).record  # a rank frozen for 30 s
    assert all("stall_s" not in r for r in records) and stalled["stall_s"] == pytest.approx(29.9)
    assert acct.stalls == [0.0] * 6 + [pytest.approx(29.9)]
    acct.cut_back(6)  # rolled back past it: its stall goes with it
    assert acct.stalls == [0.0] * 6


def test_before_a_drills_fault_rank_0_waits_until_the_controller_holds_every_record():
    """Should the fault kill rank 0, its desk dies with it: the records before it must be in the controller's hands
    already, or the controller would take the step for unfinished and fire the fault again."""
    desk = Desk(1)
    desk.put("record 1")
    assert not desk.wait_delivered(0.05)  # nobody took it
    items, cursor = desk.items(0, 0.0)
    assert items == ["record 1"] and not desk.wait_delivered(0.05)  # returned, but the reply may not have arrived
    desk.put("record 2")
    items, cursor = desk.items(cursor, 0.0)  # the controller's next poll holds record 1, and is handed record 2
    assert items == ["record 2"] and not desk.wait_delivered(0.05)
    threading.Timer(0.05, lambda: desk.items(cursor, 0.0)).start()  # the poll after says it holds record 2
    assert desk.wait_delivered(5.0)
