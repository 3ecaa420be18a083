"""`optim.schedule`: the factor of `optim.lr` per step for each schedule against its closed form, the job-file
checks of wsd's settings, and a `--resume` mid-decay training at the uninterrupted run's rates (one gloo rank in
the test's process, no Ray)."""

from __future__ import annotations

import math

import pytest

from orchestrator.errors import SpecError
from orchestrator.spec.job import JobSpec
from tests.support.one_rank import one_rank_trainer
from workers.contract.sections import OptimSection
from workers.optim.build import lr_lambda

BASE = {"warmup_steps": 2, "min_lr_ratio": 0.1, "decay_ratio": 0.1, "decay_shape": "linear"}


def factors(total: int, **optim) -> list[float]:
    factor = lr_lambda(OptimSection(**{**BASE, **optim}), total)
    return [factor(step) for step in range(total)]


def test_linear_decays_from_the_end_of_warmup_to_the_floor_at_train_steps():
    got = factors(10, schedule="linear")
    assert got[:2] == [0.5, 1.0]
    assert got[2:] == pytest.approx([0.1 + 0.9 * (1 - (s - 2) / 8) for s in range(2, 10)])
    assert lr_lambda(OptimSection(**BASE, schedule="linear"), 10)(10) == pytest.approx(0.1)  # the floor at train.steps


def test_cosine_is_unchanged():
    got = factors(10, schedule="cosine")
    assert got[2:] == pytest.approx([0.1 + 0.45 * (1 + math.cos(math.pi * (s - 2) / 8)) for s in range(2, 10)])


@pytest.mark.parametrize(("shape", "curve"), [("linear", lambda p: 1 - p),
                                              ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
                                              ("1-sqrt", lambda p: 1 - math.sqrt(p))])
def test_wsd_holds_the_rate_then_decays_over_its_last_decay_steps(shape, curve):
    got = factors(20, schedule="wsd", decay_steps=5, decay_shape=shape)
    assert got[:2] == [0.5, 1.0] and got[2:15] == [1.0] * 13  # warm-up, then stable until step 15
    assert got[15:] == pytest.approx([0.1 + 0.9 * curve((s - 15) / 5) for s in range(15, 20)])


def test_wsd_decay_ratio_is_a_share_of_train_steps_and_a_window_past_warmup_is_cut_to_what_is_left():
    assert factors(40, schedule="wsd", decay_ratio=0.25) == factors(40, schedule="wsd", decay_steps=10)
    # a smoke run of a long job (--set train.steps=6): the decay fills the steps after warm-up, nothing refused
    assert factors(6, schedule="wsd", decay_steps=1000) == factors(6, schedule="linear")


@pytest.mark.parametrize(("optim", "field", "fix"), [
    ({"decay_steps": 10}, "optim.decay_steps", "set optim.schedule: wsd, or remove optim.decay_steps"),
    ({"schedule": "cosine", "decay_shape": "1-sqrt"}, "optim.decay_shape", "set optim.schedule: wsd"),
    ({"schedule": "linear", "decay_ratio": 0.2}, "optim.decay_ratio", "set optim.schedule: wsd"),
    ({"schedule": "wsd", "decay_steps": 10, "decay_ratio": 0.2}, "optim.decay_ratio", "keep one of them"),
    ({"schedule": "constant", "min_lr_ratio": 0.0}, "optim.min_lr_ratio", "set optim.schedule: cosine"),
])
def test_a_wsd_setting_the_schedule_does_not_read_is_refused(optim, field, fix):
    with pytest.raises(SpecError, match=rf"`{field}`: value .*; fix: {fix}"):
        JobSpec.from_dict({"data": {"path": "d"}, "optim": optim})


def test_a_wsd_job_with_decay_steps_survives_the_round_trip_to_the_hosted_controller():
    """`raymesh run` hands the hosted controller ``spec.to_dict()``, which writes decay_ratio's default beside
    decay_steps; shrinks and resizes rebuild the spec the same way. None of them may read it as both set."""
    spec = JobSpec.from_dict({"data": {"path": "d"}, "optim": {"schedule": "wsd", "decay_steps": 10}})
    assert JobSpec.from_dict(spec.to_dict()).optim.decay_steps == 10
    assert spec.with_overrides(["parallel.dp=2"]).optim.decay_steps == 10
    ratio = JobSpec.from_dict({"data": {"path": "d"}, "optim": {"schedule": "wsd", "decay_ratio": 0.2}})
    # a job file's decay_ratio, switched to decay_steps from the command line: set the ratio back to its default
    assert ratio.with_overrides(["optim.decay_steps=5", "optim.decay_ratio=0.1"]).optim.decay_steps == 5


def test_a_resume_mid_decay_trains_at_the_uninterrupted_runs_rates_and_a_longer_run_stretches_the_decay(
        tmp_path_factory, tmp_path):
    """The schedule's position is the saved step count (``TrainState.progress_state``), and the factor is computed
    from it under the job's ``train.steps``: a resume continues exactly, a longer one decays to its own end."""
    optim = {"lr": 1e-3, "warmup_steps": 2, "schedule": "wsd", "decay_steps": 4, "decay_shape": "1-sqrt"}
    with one_rank_trainer(tmp_path_factory, optim=optim, train={"steps": 8}) as t:
        for _ in range(5):  # the decay starts at the fifth step (its factor still 1)
            t.train_step()
        t.checkpoints.save(tmp_path / "ckpt", async_save=False)
        uninterrupted = [t.train_step().lr for _ in range(3)]
    assert uninterrupted == pytest.approx([1e-3 * (0.1 + 0.9 * (1 - math.sqrt(s / 4))) for s in (1, 2, 3)])
    with one_rank_trainer(tmp_path_factory, optim=optim, train={"steps": 8}) as t:
        t.checkpoints.load(tmp_path / "ckpt")
        assert [t.train_step().lr for _ in range(3)] == uninterrupted
    with one_rank_trainer(tmp_path_factory, optim=optim, train={"steps": 16}) as t:
        t.checkpoints.load(tmp_path / "ckpt")
        assert t.train_step().lr == 1e-3  # step 6 of 16 is before the new decay window (steps 12 to 15)
