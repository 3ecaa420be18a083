"""The parity harness reads rank results through one helper that accepts a dict and a typed StepResult.

Why a unit test: train_step is switching from a dict to ``workers.protocol.StepResult``; this fails in
seconds if the helper stops reading either, instead of in the slow harness run.
"""

from __future__ import annotations

from tests.support.parity_harness import _as_controller_sees, step_field
from workers.protocol import StepResult, StepTimes


def test_step_field_reads_both_result_forms():
    typed = StepResult(rank=0, step=1, loss=2.5, grad_norm=1.0, lr=1e-3, tokens=8, applied=True,
                       time_s=StepTimes(), peak_memory_bytes=0, current_memory_bytes=0)
    assert step_field(typed, "loss") == step_field(typed.to_dict(), "loss") == 2.5


def test_loss_is_the_mean_over_last_stage_ranks_and_the_norm_is_rank0s():
    run = _as_controller_sees({0: [(None, 3.0)], 1: [(2.0, 3.0)], 2: [(None, 3.0)], 3: [(4.0, 3.0)]}, steps=1)
    assert run.losses == [3.0] and run.grad_norms == [3.0]
