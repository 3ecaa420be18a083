"""A rank process's stacks read from outside it (``workers.diagnostics.stacks``), frozen or running: what the
controller writes into the run dir when a rank misses its progress deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from workers.diagnostics import stacks
from workers.loop.desk import Desk
from workers.loop.loop import HUNG, RankLoop
from workers.loop.plan import Request, StepRecord, Window
from workers.loop.summary import StepSummary
from workers.loop.tree import LocalTransport, TreeExchange
from workers.protocol import StepResult, StepTimes

CHILD = """
import sys, time, threading
from workers.diagnostics import stacks
stacks.install()
def waiting_in_the_boundary():
    print("ready", flush=True)
    while True:
        time.sleep(0.01)
threading.Thread(target=lambda: time.sleep(60), name="helper", daemon=True).start()
waiting_in_the_boundary()
"""


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


def _stops(pid: int) -> bool:
    """Whether ``pid`` is (or within a second becomes) stopped: the kernel stops it shortly after the signal."""
    for _ in range(100):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return True
        time.sleep(0.01)
    return False


def test_a_running_process_writes_every_threads_stack(child):
    (text,) = stacks.dump({3: child.pid}).values()
    assert "in waiting_in_the_boundary" in text
    assert text.count("Thread 0x") + text.count("Current thread 0x") == 2  # the main thread and the helper


def test_a_stopped_process_writes_its_stack_and_is_stopped_again(child):
    os.kill(child.pid, signal.SIGSTOP)
    assert _stops(child.pid)
    first = stacks.dump({0: child.pid})
    assert "in waiting_in_the_boundary" in first[0]
    assert _stops(child.pid)  # frozen as it was: the controller kills it next
    second = stacks.dump({0: child.pid})  # only what the second dump wrote, not the first again
    assert second[0].count("in waiting_in_the_boundary") == 1


def test_a_process_without_the_handler_or_gone_is_left_out():
    ignoring = "import signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); print('ready', flush=True); " \
               "time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", ignoring], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    try:
        assert stacks.dump({1: proc.pid, 2: 2 ** 22 + 7}, wait_s=0.3) == {}
    finally:
        proc.kill()
        proc.wait()


class _Steps:
    """A one-rank stepper that records its snapshots."""

    def __init__(self):
        self.step, self.snapshots = 0, []

    def run_step(self, faults, detail):
        self.step += 1
        return StepSummary.of(StepResult(rank=0, step=self.step, loss=1.0, grad_norm=0.5, lr=1e-3, tokens=8,
                                         applied=True, time_s=StepTimes(compute=0.1, step=0.1), peak_memory_bytes=1,
                                         current_memory_bytes=1, replicated_step=self.step - 1), detail)

    def skip_batch(self): ...
    def snapshot(self, keep_from): self.snapshots.append(self.step)
    def save_state(self): return None
    def finish_save(self): return None
    def save(self, path, async_save, dir_mode): return None


def test_a_step_that_completes_while_a_hang_is_diagnosed_keeps_nothing():
    """Writing a frozen rank's stacks continues it for a moment, in which its step may complete: that step must
    leave no record and no snapshot (the snapshot would drop the one the recovery rolls back to)."""
    desk, steps = Desk(), _Steps()
    desk.post(Request(stop=HUNG))
    end = RankLoop(steps, TreeExchange(0, 1, LocalTransport()), desk).run(Window(until=5, snapshot_every=1))
    assert (end.step, end.reason) == (0, HUNG)
    assert steps.snapshots == [] and not any(isinstance(item, StepRecord) for item in desk.items(0, 0)[0])


def test_where_waits_for_no_answer_from_a_stopped_process(child):
    """A SIGSTOPped rank answers nothing until continued: the agent does not wait out its deadline for it (the
    frozen rank's diagnosis used to wait 5 s here); a running one is waited for until it answers."""
    from workers.agent import wait_unless_stopped

    def never_sleep(seconds):
        raise AssertionError("waited for a stopped process")

    os.kill(child.pid, signal.SIGSTOP)
    assert _stops(child.pid)
    wait_unless_stopped({1: "call"}, {1: child.pid}, 600.0, done=lambda call: False, sleep=never_sleep)
    os.kill(child.pid, signal.SIGCONT)
    answered = []
    wait_unless_stopped({1: "call"}, {1: child.pid}, 600.0, done=lambda call: bool(answered),
                        sleep=lambda seconds: answered.append(seconds))
    assert len(answered) == 1  # running: waited (once) until its call was done
