"""A controller that outlives its driver: ``raymesh run`` hosts it in a detached actor and only follows it.

Both tests compare against one uninterrupted run of the same tiny job: the driver SIGKILLed mid-run (the
job trains on through a seeded pair of rank faults with no driver attached, and ``raymesh attach`` shows it
to the end: the chaos schedule's "kill driver"), and the controller actor itself killed (Ray restarts it and
it resumes from the newest checkpoint).
"""

from __future__ import annotations

import json
import random

import pytest
import ray

from orchestrator import JobSpec
from orchestrator.runtime.hosted import HostedJob
from tests.support.driver import job_file, kill_group, output, raymesh, slowed, start_raymesh
from tests.support.jobs import tiny_spec, wait_for
from tests.support.parity_harness import run_spec

STEPS = 14  # slowed (tests/support/driver.py): the driver and controller kills land mid-run


def spec_for(token_data, folder, steps: int = STEPS):
    return tiny_spec(token_data, folder, train={"steps": steps}, checkpoint={"every": 5})


def slow_job(token_data, folder, steps: int = STEPS):
    return job_file(slowed(spec_for(token_data, folder, steps)), folder)


@pytest.fixture(scope="module")
def uninterrupted(token_data, tmp_path_factory) -> list[float]:
    """The job's losses uninterrupted, from the Ray-free harness (the same Trainer gives a Ray job's bits)."""
    return run_spec(spec_for(token_data, tmp_path_factory.mktemp("ref"))).losses


def with_rank_faults(spec, seed: int):
    """``spec`` plus a kill and a raised step on seeded ranks and steps, late enough to come after the driver is
    killed (at step 2): the hosted controller recovers them with nobody attached (from disk: one rank)."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(8, STEPS - 2), 2))
    faults = [{"kind": kind, "rank": rng.randrange(spec.parallel.world_size), "at_step": step}
              for kind, step in zip(("kill_rank", "raise_error"), steps, strict=True)]
    return JobSpec.from_dict({**spec.to_dict(), "faults": spec.to_dict()["faults"] + faults}), faults


def step_of(job_id: str) -> int:
    job = HostedJob.find(job_id)
    status = job.status() if job is not None else {}
    return status.get("step", 0)


def test_killing_the_driver_leaves_the_run_training_and_attach_shows_it_end(ray_cluster, token_data, tmp_path,
                                                                            uninterrupted):
    spec, faults = with_rank_faults(slowed(spec_for(token_data, tmp_path)), seed=12)
    job = job_file(spec, tmp_path)
    driver = start_raymesh(ray_cluster, "run", str(job), "--id", "driver-killed", out=tmp_path / "run")
    try:
        wait_for(lambda: step_of("driver-killed") >= 2, 180, "the hosted run to train two steps")
        driver.kill()  # SIGKILL: nothing of the driver gets to run
        driver.wait()
        assert step_of("driver-killed") < STEPS, "the run ended before its driver was killed: the test proved nothing"
        attached = raymesh(ray_cluster, "attach", "driver-killed", "--no-progress",
                           "--summary-json", str(tmp_path / "attached.json"))
    finally:
        kill_group(driver)
    assert attached.returncode == 0, attached.stdout + attached.stderr
    assert f"done: {STEPS} steps" in attached.stdout
    summary = json.loads((tmp_path / "attached.json").read_text())
    assert summary["status"] == "finished" and summary["losses"] == uninterrupted, faults
    assert [(r["kind"], r["at_step"]) for r in summary["recoveries"]] == [
        ({"kill_rank": "rank", "raise_error": "error"}[f["kind"]], f["at_step"]) for f in faults], faults
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["losses"] == uninterrupted
    assert HostedJob.find("driver-killed") is None  # attach collected the outcome and let the actor go


def killing_the_controller(ray_cluster, token_data, tmp_path, job_id: str, after: int, for_good: bool):
    """``raymesh run`` of the slowed job (``--summary-json`` beside it), its controller actor killed once it has
    trained ``after`` steps (``for_good``: Ray does not restart it); (the driver, its output path)."""
    out = tmp_path / "driver"
    driver = start_raymesh(ray_cluster, "run", str(slow_job(token_data, tmp_path)), "--id", job_id, "--no-progress",
                           "--summary-json", str(tmp_path / "summary.json"), out=out)
    try:
        wait_for(lambda: step_of(job_id) >= after, 180, f"the run to train {after} steps")
        ray.kill(HostedJob.find(job_id).handle, no_restart=for_good)
    except BaseException:
        kill_group(driver)
        raise
    return driver, out


def test_a_lost_controller_resumes_from_its_newest_checkpoint(ray_cluster, token_data, tmp_path, uninterrupted):
    # a checkpoint at step 5 and two more steps; the process dies, Ray restarts it
    driver, out = killing_the_controller(ray_cluster, token_data, tmp_path, "controller-killed", 7, for_good=False)
    try:
        wait_for(lambda: "event=resume path=" in output(out)[1], 120, "the restarted controller to resume")
        held = [pg for pg in ray.util.placement_group_table().values()
                if pg["name"].startswith("raymesh-job-tp") and pg["state"] != "REMOVED"]
        assert len(held) == 1, held  # Ray gave the lost controller's reservation back: nothing is leaked
        assert driver.wait(timeout=300) == 0, output(out)
    finally:
        kill_group(driver)
    stderr = output(out)[1]
    assert "was lost; waiting for Ray to restart it" in stderr
    assert "event=controller_restarted job_id=controller-killed" in stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    resumed_at = int(summary["resumed_from"].rsplit("-", 1)[1])
    assert resumed_at >= 5 and resumed_at % 5 == 0
    assert summary["losses"] == uninterrupted[resumed_at:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert {s["step"]: s["loss"] for s in steps} == dict(enumerate(uninterrupted, start=1))
    # the loss is the run's record like any other: the lost life's steps past the checkpoint, trained again
    lost_life = steps[:len(steps) - (STEPS - resumed_at)]
    assert [s["step"] for s in lost_life] == list(range(1, len(lost_life) + 1)) and len(lost_life) >= 7
    [loss] = summary["recoveries"]
    assert (loss["kind"], loss["at_step"], loss["lost_steps"]) == ("controller", resumed_at + 1,
                                                                  len(lost_life) - resumed_at), loss
    first_again = steps[len(lost_life)]
    assert loss["mttr_s"] == pytest.approx(first_again["time"] - lost_life[-1]["time"], abs=1.0)
    assert "event=recovered kind=controller" in stderr


def test_a_controller_ray_will_not_restart_ends_the_follow_at_once_with_a_failed_summary(ray_cluster, token_data,
                                                                                       tmp_path):
    # killed for good: what Ray does when its last restart is used up
    driver, out = killing_the_controller(ray_cluster, token_data, tmp_path, "controller-gone", 3, for_good=True)
    try:
        assert driver.wait(timeout=120) == 1, output(out)  # it waited 300 s for a restart Ray never makes
    finally:
        kill_group(driver)
    stderr = output(out)[1]
    assert "raymesh: the controller of job controller-gone is gone for good" in stderr
    assert "continue with `raymesh run JOB --resume`" in stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] >= 3 and "restart(s) of at most 3" in summary["error"]
    assert summary == json.loads((tmp_path / "summary.json").read_text())


def test_status_inject_and_stop_find_a_run_by_the_job_id_it_printed(ray_cluster, token_data, tmp_path):
    """The run is stopped, so it may be long: after its second step it must outlast three CLI processes (status,
    inject, stop), a second or more each, which the 12 steps left of STEPS (~0.25 s each slowed on a fast machine)
    need not do."""
    out = tmp_path / "driver"
    job = slow_job(token_data, tmp_path, steps=100)
    driver = start_raymesh(ray_cluster, "run", str(job), "--id", "by-id", "--no-progress", out=out)
    try:
        wait_for(lambda: step_of("by-id") >= 2, 180, "the hosted run to train two steps")
        assert "raymesh attach by-id" in output(out)[1]
        status = raymesh(ray_cluster, "status", "by-id")
        assert status.returncode == 0 and "raymesh-job by-id: running, step" in status.stdout, status.stderr
        inject = raymesh(ray_cluster, "inject", "by-id", "--kind", "slow_rank", "--rank", "0", "--factor", "30")
        assert inject.returncode == 0 and "by-id: slow_rank on rank 0 at step" in inject.stdout, inject.stderr
        stop = raymesh(ray_cluster, "stop", "by-id", "--reason", "test over")
        assert stop.returncode == 0 and "by-id: stopping (the controller finishes" in stop.stdout, stop.stderr
        assert driver.wait(timeout=120) == 0, output(out)
    finally:
        kill_group(driver)
    assert "event=fault_requested kind=slow_rank rank=0" in output(out)[1]
    assert "event=stop_requested job=raymesh-job reason=\"test over\"" in output(out)[1]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "stopped"
