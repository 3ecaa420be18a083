"""What a step records is what the step ran with: fp16's dynamic loss scale never reaches the recorded loss (a
step whose gradients overflowed, skipped, and a step at which the scale grows both record the loss their forward
computed, unscaled by the scale it ran at), and the learning rate is the one the update used, not the next one."""

from __future__ import annotations

import math
import warnings

import pytest

from tests.support.one_rank import one_rank_trainer


@pytest.fixture(scope="module")
def fp16_trainer(tmp_path_factory):
    with one_rank_trainer(tmp_path_factory, precision={"dtype": "fp16", "initial_loss_scale": 2.0 ** 60},
                          optim={"lr": 0.01, "warmup_steps": 1000}, train={"steps": 2000}) as t:
        yield t


def test_a_skipped_and_a_growing_step_record_the_unscaled_loss(fp16_trainer):
    byte_entropy = math.log(256)  # an untrained byte model's loss, whatever the scale
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        skipped = fp16_trainer.train_step()
    # the schedule passes a skipped step's LR on purpose (PyTorch's AMP recipe): no warning in the rank's log
    assert not [w for w in caught if "lr_scheduler.step" in str(w.message)]
    assert math.isnan(skipped.grad_norm)  # 2**60 overflows fp16 gradients: the step was skipped
    assert skipped.loss == pytest.approx(byte_entropy, abs=0.5)  # was the loss times 2**60
    scaler = fp16_trainer.state.scaler
    while not math.isfinite(fp16_trainer.train_step().grad_norm):
        pass  # halve until the gradients fit
    scaler.growth_interval, scaler.good_steps = 1, 0  # the next good step grows the scale
    before = scaler.scale
    grown = fp16_trainer.train_step()
    assert scaler.scale == 2 * before and math.isfinite(grown.grad_norm)
    assert grown.loss == pytest.approx(byte_entropy, abs=0.5)  # was halved: divided by the grown scale


def test_the_recorded_learning_rate_is_the_one_the_step_trained_at(fp16_trainer):
    """Under warmup step n trains at lr·n/warmup (``lr_lambda``); the schedule has moved on by the time the step
    returns, so reading it then recorded step n + 1's rate."""
    result = fp16_trainer.train_step()
    assert result.lr == pytest.approx(0.01 * result.step / 1000, rel=1e-9)
