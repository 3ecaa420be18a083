"""The parity harness turns the ranks' step results (``StepResult.to_dict()``) into what the controller records.

Why a unit test: this fails in seconds if the harness misreads them, instead of in the slow harness run.
"""

from __future__ import annotations

from tests.support.parity_harness import _as_controller_sees
from workers.protocol import StepResult, StepTimes


def _result(rank: int, loss: float | None) -> dict:
    return StepResult(rank=rank, step=1, loss=loss, grad_norm=3.0 + rank, lr=1e-3, tokens=8, applied=True,
                      time_s=StepTimes(), peak_memory_bytes=0, current_memory_bytes=0,
                      comm_bytes={"dp": rank}).to_dict()


def test_loss_is_the_mean_over_last_stage_ranks_and_the_norm_is_rank0s():
    run = _as_controller_sees({r: [_result(r, loss)] for r, loss in enumerate([None, 2.0, None, 4.0])}, steps=1)
    assert run.losses == [3.0] and run.grad_norms == [3.0]
    assert run.field("comm_bytes") == {r: [{"dp": r}] for r in range(4)}  # every rank's own results kept
