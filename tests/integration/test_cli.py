"""Bad input is refused before any actor starts, with a message naming the field, the value and the fix."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import ray
from ray.util.state import list_actors

from orchestrator import SpecError, TrainingJob
from orchestrator.runtime.hosted import HostedJob
from tests.support import driver as drivers
from tests.support.jobs import tiny_spec, wait_for
from tests.support.parity_harness import run_spec


def raymesh(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env={"PATH": "/usr/bin:/bin", "RAY_ADDRESS": ""}, timeout=120)


def write_job(tmp_path, body: str):
    job = tmp_path / "job.yaml"
    job.write_text(body)
    return job


def test_missing_data_fails_before_ray_starts(tmp_path):
    job = write_job(tmp_path, f"data:\n  path: {tmp_path / 'nowhere'}\n")
    t0 = time.monotonic()
    proc = raymesh("run", str(job))
    assert proc.returncode == 2
    assert "`data.path`" in proc.stderr and "raymesh prepare-data --out" in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr
    assert time.monotonic() - t0 < 60


def test_run_prepares_a_missing_default_corpus_then_checks_it_before_ray_starts(tmp_path):
    """`data.path: .../stdlib` that is not there is prepared by `raymesh run` (the quick start's one command); the
    pre-start checks then run on the prepared data: here they refuse a vocabulary too small for it, so no Ray."""
    corpus = tmp_path / "data" / "stdlib"
    job = write_job(tmp_path, f"data:\n  path: {corpus}\nmodel:\n  vocab_size: 128\nrun_dir: {tmp_path / 'run'}\n")
    proc = raymesh("run", str(job))
    assert proc.returncode == 2, proc.stderr
    assert "event=prepare_data" in proc.stderr and "event=data_ready" in proc.stderr
    assert json.loads((corpus / "manifest.json").read_text())["tokenizer"]["vocab_size"] == 256
    assert "`model.vocab_size`" in proc.stderr and "Started a local Ray instance" not in proc.stderr


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.n_head=4", r"`model.n_head`: unknown field; fix: did you mean `n_heads`"),
        ("parallel.tp=3",
         r"`parallel.tp`: value 3 does not divide model.n_heads=4.*fix: pick parallel.tp from \[1, 2, 4\]"),
        ("parallel.pp=3", r"`model.n_layers`: value 4 does not split evenly.*fix:"),
        ("train.microbatches=3", r"`train.microbatches`: value 3 does not divide.*fix: pick train.microbatches from"),
        ("parallel.zero=5", r"`parallel.zero`: value 5.*"),
        ("train.global_batch_size=6", r"`train.global_batch_size`: value 6 is not divisible by parallel.dp=4"),
    ],
)
def test_cli_reports_bad_fields(tmp_path, override, expected):
    job = write_job(tmp_path, "data:\n  path: data\nparallel:\n  dp: 4\n")
    proc = raymesh("plan", str(job), "--set", override)
    assert proc.returncode == 2, proc.stdout
    assert "Traceback" not in proc.stderr
    assert re.search(expected, proc.stderr), proc.stderr


def test_override_without_equals_is_explained(tmp_path):
    job = write_job(tmp_path, "data:\n  path: data\n")
    proc = raymesh("plan", str(job), "--set", "parallel.dp")
    assert proc.returncode == 2 and "key.path=value" in proc.stderr


def test_more_ranks_than_the_cluster_has_is_refused_before_any_actor(ray_cluster, token_data, tmp_path):
    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 16}, train={"global_batch_size": 16, "microbatches": 1})
    actors_before = len(list_actors(filters=[("state", "=", "ALIVE")]))
    with pytest.raises(SpecError, match=r"parallel.dp\*pp\*tp.*16.*fix:"):
        TrainingJob(spec, progress=False).run()
    assert len(list_actors(filters=[("state", "=", "ALIVE")])) == actors_before


def test_plan_prints_the_layout_and_memory(tmp_path):
    job = write_job(tmp_path, "data:\n  path: data\nparallel:\n  dp: 2\n  pp: 2\n  tp: 2\ntrain:\n  microbatches: 2\n")
    proc = raymesh("plan", str(job))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "dp=2 x pp=2 x tp=2 = 8 ranks" in lines[0]
    assert lines[1].startswith("pp_split [") and "layers per stage" in lines[1]  # pp > 1: how layers are split
    assert len(lines) == 3 + 8 + 1
    assert lines[-1].startswith("in-memory snapshots: 2 copies")  # the host memory each rank's placement reserves


def test_ctrl_c_stops_with_a_checkpoint_and_the_resume_command_then_a_finished_run_stays_finished(
        ray_cluster, token_data, tmp_path):
    spec = tiny_spec(token_data, tmp_path, train={"steps": 12}, checkpoint={"every": 100})
    uninterrupted = run_spec(tiny_spec(token_data, tmp_path / "ref", train={"steps": 12}))
    job = drivers.job_file(drivers.slowed(spec), tmp_path)
    out = tmp_path / "driver"
    driver = drivers.start_raymesh(ray_cluster, "run", str(job), "--id", "ctrl-c", "--set", "train.steps=12", out=out)
    try:
        wait_for(lambda: (h := HostedJob.find("ctrl-c")) is not None and h.status().get("step", 0) >= 3, 180,
                 "the run to train three steps")
        driver.send_signal(signal.SIGINT)
        assert driver.wait(timeout=120) == 0, drivers.output(out)
    finally:
        drivers.kill_group(driver)
    stdout, stderr = drivers.output(out)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    stopped = json.loads((tmp_path / "run" / "summary.json").read_text())
    step = stopped["steps"]
    assert stopped["status"] == "stopped" and 3 <= step < 12
    assert (tmp_path / "run" / "checkpoints" / f"step-{step:08d}").is_dir()
    command = f"raymesh run {job} --set train.steps=12 --resume"
    assert f"stopped at step {step} (checkpoint {tmp_path / 'run' / 'checkpoints'}/step-{step:08d}); resume with:\n" \
           f"  {command}" in stdout

    # typed as printed, in a shell with no RAY_ADDRESS: the run joins the head `ray start` runs on this machine
    resumed = drivers.raymesh(ray_cluster, *shlex.split(command)[1:], "--no-progress", by_address=False)
    assert resumed.returncode == 0, resumed.stderr
    summary_file = tmp_path / "run" / "summary.json"
    finished = json.loads(summary_file.read_text())
    assert finished["status"] == "finished" and finished["losses"] == uninterrupted.losses[step:]
    assert {r["node_id"] for r in finished["layout"]["ranks"]} <= {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    run = tmp_path / "run"  # the end of a run: a short summary saying where things are, not kilobytes of JSON
    assert f"done: 12 steps, final loss {finished['final_loss']:.4f}" in resumed.stdout
    assert f"  summary: {run / 'summary.json'}\n  report: raymesh report {run}\n" in resumed.stdout
    assert "event=summary" not in resumed.stdout + resumed.stderr and len(resumed.stdout) < 1000
    assert "event=layout" in resumed.stderr and "schedule=" not in resumed.stderr  # pp=1: no pipeline fields

    before = summary_file.read_bytes()
    again = drivers.raymesh(ray_cluster, *shlex.split(command)[1:], "--no-progress")
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    assert f"the run in {tmp_path / 'run'} is complete" in again.stdout and "at step 12" in again.stdout
    assert summary_file.read_bytes() == before


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs, where every checkpoint save fails with ENOSPC as on a full disk (mounting one needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs for a real full disk needs root")
    mount = tmp_path / "full"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_checkpoint_disk_fails_the_run_and_a_second_run_into_its_run_dir_is_refused(
        ray_cluster, token_data, tmp_path, full_disk):
    """Every save fails, the last one too: the run ends failed (exit 1) saying the cause, the folder and the steps
    not kept, never "finished" over an old checkpoint; meanwhile a second run of the job under another --id is
    refused at once, naming the first, instead of training into the same run dir."""
    spec = tiny_spec(token_data, tmp_path, train={"steps": 12}, checkpoint={"every": 4, "dir": str(full_disk)})
    job = drivers.job_file(drivers.slowed(spec), tmp_path)
    out = tmp_path / "driver"
    first = drivers.start_raymesh(ray_cluster, "run", str(job), "--id", "full-a", "--no-progress", out=out)
    try:
        wait_for(lambda: (h := HostedJob.find("full-a")) is not None and h.status().get("step", 0) >= 1, 180,
                 "the first run to train a step")
        second = drivers.raymesh(ray_cluster, "run", str(job), "--id", "full-b", "--no-progress")
        assert second.returncode == 2, second.stderr
        assert "is in use by another run: job full-a (pid " in second.stderr and "Traceback" not in second.stderr
        assert first.wait(timeout=300) == 1, drivers.output(out)
    finally:
        drivers.kill_group(first)
    stdout, stderr = drivers.output(out)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and len(summary["losses"]) == 12
    failure = summary["checkpoint_failure"]
    assert (failure["step"], failure["last_on_disk"], failure["steps_not_kept"]) == (12, None, "1-12")
    assert "No space left on device" in failure["reason"] and f"{full_disk}/step-00000012" in failure["reason"]
    failed = [line for line in stderr.splitlines() if "event=checkpoint_failed" in line]
    assert failed and all("No space left on device" in line and str(full_disk) in line for line in failed)
    assert "RankWorker object" not in stderr and "status=failed" in stderr
    assert "steps 1-12 are not kept: no checkpoint of it is on disk" in stderr and "--resume" not in stderr
    assert "newest checkpoint: none (steps 1-12 not kept)" in stdout
