"""ZeRO-1 (workers/parallel/distributed_optimizer.py) on every layout, offloaded, and through a checkpoint.

Ray-free (tests/support/parity_harness.py): the layouts' ranks are spawned processes over gloo. Parity is
against the single-process reference (fp32, CPU, 1e-4 relative); a resume at the same layout must continue
bit for bit, and one at another dp (DCP reshards the sliced state) to 1e-4.
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layout
from tests.support.reference import reference_run

STEPS = 4
OFFLOAD = {"memory": {"offload": {"optimizer": True}}}


def _spec(token_data, tmp_path, parallel: dict, **sections):
    return tiny_spec(token_data, tmp_path, parallel={**parallel, "device": "cpu", "zero": 1},
                     train={"steps": STEPS}, **sections)


@pytest.fixture(scope="module")
def reference(token_data, tmp_path_factory):
    spec = _spec(token_data, tmp_path_factory.mktemp("ref"), {})
    return reference_run(spec, STEPS)


def _assert_reference(run, reference, steps: int) -> None:
    losses, grad_norms = reference
    assert run.losses[:steps] == pytest.approx(losses[:steps], rel=1e-4)
    assert run.grad_norms[:steps] == pytest.approx(grad_norms[:steps], rel=1e-4)


def test_zero1_with_pipeline_and_tensor_parallel_reproduces_the_reference(reference, token_data, tmp_path):
    spec = _spec(token_data, tmp_path, {"pp": 2, "tp": 2, "dp": 2})
    _assert_reference(run_layout(spec.worker_dict(), 8, 3), reference, 3)


def test_zero1_offloaded_reproduces_the_reference_and_resumes_bit_identically(reference, token_data, tmp_path):
    """One dp=2 run with the optimizer in the offload store saves after step 2 and goes on to step 4; the
    resumed run must repeat steps 3-4 exactly, and a dp=1 run resumed from the same slices to 1e-4 (moments
    lost or misplaced would move step 4's loss far more than that)."""
    spec, saved = _spec(token_data, tmp_path, {"dp": 2}, **OFFLOAD), str(tmp_path / "step2")
    straight = run_layout(spec.worker_dict(), 2, STEPS, checkpoint=saved, save_after=2)
    _assert_reference(straight, reference, STEPS)
    resumed = run_layout(spec.worker_dict(), 2, STEPS - 2, resume=saved)
    assert resumed.losses == straight.losses[2:] and resumed.grad_norms == straight.grad_norms[2:]
    single = _spec(token_data, tmp_path / "single", {"dp": 1}, **OFFLOAD)  # the offloaded Adam's param groups
    resharded = run_layout(single.worker_dict(), 1, STEPS - 2, resume=saved)
    assert resharded.losses == pytest.approx(straight.losses[2:], rel=1e-4)
    assert resharded.grad_norms == pytest.approx(straight.grad_norms[2:], rel=1e-4)
