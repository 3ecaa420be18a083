"""`optim.name: muon` on parallel layouts reproduces the single-process reference (fp32, CPU, 1e-4 relative), whose
Muon and AdamW are PyTorch's own built by hand (tests/support/reference.py): losses and global gradient norms.

Each layout hands Muon its matrices differently: ZeRO-0 plain tensors (DDP), ZeRO-3 FSDP2's dim-0 DTensor shards and
TP's row and column shards, which ``WholeMatrixMuon`` gathers whole for the Newton-Schulz iteration, and a pipeline's
stages, each stepping its own matrices. Ranks are spawned processes over gloo (tests/support/parity_harness.py, no
Ray), every layout at world size 2 in one spawn, 3 steps each; the reference is computed once.
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped
from tests.support.reference import reference_run

STEPS = 3
OPTIM = {"name": "muon", "lr": 0.01, "weight_decay": 0.1}
LAYOUTS = {
    "dp2-zero0": {"dp": 2},
    "dp2-zero3": {"dp": 2, "zero": 3},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
}


def _spec(token_data, tmp_path, parallel: dict | None = None):
    return tiny_spec(token_data, tmp_path, parallel={**(parallel or {}), "device": "cpu"}, optim=OPTIM,
                     train={"steps": STEPS})


@pytest.fixture(scope="module")
def reference(token_data, tmp_path_factory):
    return reference_run(_spec(token_data, tmp_path_factory.mktemp("muon-reference")), STEPS)


@pytest.fixture(scope="module")
def runs(token_data, tmp_path_factory):
    """Every layout's ranks in one spawn of two (``run_grouped``)."""
    tmp = tmp_path_factory.mktemp("muon-parity")
    return run_grouped({name: _spec(token_data, tmp / name, p) for name, p in LAYOUTS.items()})


def test_the_reference_is_not_adamw(token_data, reference, tmp_path):
    """Not a vacuous comparison: Muon moves the losses away from AdamW's at the same rate."""
    adamw = tiny_spec(token_data, tmp_path, optim={"lr": 0.01, "weight_decay": 0.1}, train={"steps": STEPS})
    assert reference_run(adamw, STEPS)[0] != pytest.approx(reference[0], rel=1e-4)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_layout_matches_single_process_reference(name, reference, runs):
    run = ran(runs, name)
    losses, grad_norms = reference
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4)
