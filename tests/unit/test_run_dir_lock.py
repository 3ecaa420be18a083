"""One run at a time in a run dir (and a checkpoint dir): a second run is refused at once naming the first, a lock
whose holder died is free again, and a hosted controller's new life waits for its previous life's lock. Ray-free."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from orchestrator import TrainingJob
from orchestrator.checkpoints.dir_lock import LOCK_FILE, DirBusy, check_free
from orchestrator.cli import main
from tests.support.controller_jobs import make_job
from tests.support.fake_group import FakeRuntime

REPO = Path(__file__).resolve().parents[2]
HOLD = """
import sys
from orchestrator import JobSpec
from orchestrator.checkpoints.dir_lock import DirLocks
DirLocks(JobSpec.from_dict({"data": {"path": "d"}, "run_dir": sys.argv[1]}), sys.argv[2]).acquire()
print("held", flush=True)
sys.stdin.read()  # until the test closes our stdin (or kills us)
"""


@pytest.fixture
def holder(tmp_path):
    """Start a process that takes the run dir's lock as job ``job`` and keeps it until its stdin closes."""
    procs = []

    def start(job: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run"), job], cwd=REPO, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        procs.append(proc)
        assert proc.stdout.readline() == "held\n"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_second_run_into_a_run_dir_in_use_is_refused_at_once_naming_the_first(tmp_path):
    first_runtime, second_runtime = FakeRuntime(), FakeRuntime()
    first = make_job(tmp_path, runtime=first_runtime)
    training, go_on = threading.Event(), threading.Event()
    first_runtime.script[3] = lambda: (training.set(), go_on.wait(60))
    thread = threading.Thread(target=first.run)
    thread.start()
    try:
        assert training.wait(60)
        second = make_job(tmp_path, runtime=second_runtime)
        second.locks.job = "other-id"
        with pytest.raises(DirBusy, match=rf"`run_dir`: value '{tmp_path / 'run'}' is in use by another run: job "
                                          rf"raymesh-job \(pid {os.getpid()} on host {socket.gethostname()}, since "
                                          rf"\d{{4}}-.*\) holds .*{LOCK_FILE}; fix: wait for that run to end or stop "
                                          rf"it \(`raymesh stop raymesh-job`\), or give this run another run_dir"):
            second.run()
        assert second_runtime.groups == []  # refused before anything started
    finally:
        go_on.set()
        thread.join(60)
    records = (first.run_dir / "steps.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in records] == list(range(1, 11))  # the first run's records are whole
    make_job(tmp_path, runtime=FakeRuntime()).run()  # it ended: the run dir is free again


def test_a_checkpoint_dir_shared_by_two_run_dirs_is_refused_naming_it(tmp_path):
    shared = {"dir": str(tmp_path / "shared-ckpt"), "every": 0, "memory_every": 1}
    first = make_job(tmp_path / "a", checkpoint=shared)
    first.locks.acquire()
    try:
        with pytest.raises(DirBusy, match=r"`checkpoint.dir`: value '.*shared-ckpt' is in use by another run"):
            make_job(tmp_path / "b", checkpoint=shared).run()
    finally:
        first.locks.release()


def test_a_lock_whose_holder_was_killed_is_free(tmp_path, holder):
    proc = holder("job-a")
    spec = make_job(tmp_path).spec
    with pytest.raises(DirBusy, match=rf"job job-a \(pid {proc.pid} on host "):
        check_free(spec)
    with pytest.raises(DirBusy, match=rf"job job-a \(pid {proc.pid} on host "):
        make_job(tmp_path).run()
    proc.send_signal(signal.SIGKILL)  # dies without a word: the kernel drops its lock
    proc.wait()
    check_free(spec)
    assert make_job(tmp_path).run().status == "finished"


def test_a_restarted_controller_waits_for_its_previous_lifes_lock_and_no_one_elses(tmp_path, holder):
    """On NFS a dead host's lock lasts until the server's lease ends: the new life of the same job waits it out,
    while any other run is refused at once."""
    proc = holder("job-a")
    with pytest.raises(DirBusy, match="job job-a"):
        TrainingJob(make_job(tmp_path).spec, progress=False, runtime=FakeRuntime(), restarted=True,
                    job_id="job-b").run()
    restarted = TrainingJob(make_job(tmp_path).spec, progress=False, runtime=FakeRuntime(), restarted=True,
                            job_id="job-a")
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(result=restarted.run()))
    thread.start()
    proc.stdin.close()  # the previous life ends while the new one waits
    thread.join(120)
    assert outcome["result"].status == "finished"


def test_raymesh_run_into_a_run_dir_in_use_is_refused_before_ray_starts(tmp_path, holder, monkeypatch, capsys):
    from orchestrator.runtime import cluster
    from orchestrator.runtime.ray_runtime import RayRuntime

    def started(*args, **kwargs):
        raise AssertionError("the command went on past the run dir's lock")

    monkeypatch.setattr(RayRuntime, "preflight", started)
    monkeypatch.setattr(cluster, "connect", started)
    proc = holder("job-a")
    (tmp_path / "job.yaml").write_text(json.dumps({"data": {"path": str(tmp_path / "data")},
                                                   "run_dir": str(tmp_path / "run")}))
    code = main(["run", str(tmp_path / "job.yaml"), "--id", "job-b"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"is in use by another run: job job-a (pid {proc.pid} on host {socket.gethostname()}" in err
    assert "`raymesh stop job-a`" in err
