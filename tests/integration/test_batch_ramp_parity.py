"""``train.batch_ramp`` on a data-parallel layout, without Ray (tests/support/parity_harness.py; fp32, CPU): the
ramping run equals the single-process reference taking the same batches (1e-4), and a run resumed from its
checkpoint in the middle of the ramp goes on exactly as the unbroken one (the data position counts sequences,
the batch follows the step)."""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layout
from tests.support.reference import reference_run

STEPS = 5
RAMP = {"start": 4, "steps": 3, "increment": 4}  # batches of 4, 8, 12, then 16 sequences


@pytest.fixture(scope="module")
def spec(token_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ramp")
    return tiny_spec(token_data, tmp, parallel={"dp": 2, "zero": 1, "device": "cpu"},
                     train={"steps": STEPS, "global_batch_size": 16, "microbatches": 2, "batch_ramp": RAMP})


def test_a_ramping_run_matches_the_reference_and_resumes_mid_ramp_exactly(spec, tmp_path):
    saved = str(tmp_path / "step-2")
    whole = run_layout(spec.worker_dict(), 2, STEPS, checkpoint=saved, save_after=2)
    assert [r["global_batch"] for r in whole.results[0]] == [4, 8, 12, 16, 16]
    losses, grad_norms = reference_run(spec, STEPS)
    assert whole.losses == pytest.approx(losses, rel=1e-4)
    assert whole.grad_norms == pytest.approx(grad_norms, rel=1e-4)
    resumed = run_layout(spec.worker_dict(), 2, STEPS - 2, resume=saved)
    assert resumed.losses == whole.losses[2:]
    assert resumed.grad_norms == whole.grad_norms[2:]
