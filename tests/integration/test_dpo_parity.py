"""DPO with LoRA (``train.objective: dpo``) on parallel layouts reproduces the single-process reference (fp32, CPU,
1e-4 relative): losses and global gradient norms, 3 steps, and every layout reports the same reward figures.

The reference (tests/support/reference.py, ``_dpo_objective``) scores the whole global batch at once against a
second, frozen copy of the model; the layouts split the pairs over dp ranks and microbatches, shard the weights
(ZeRO-3) or the layers (tp, with and without sequence parallelism), and score the reference with their own
adapters disabled. Ranks are spawned processes over gloo (tests/support/parity_harness.py, no Ray), every layout
at world size 2 in one spawn.
"""

from __future__ import annotations

import pytest

from tests.support.dpo import prepare_pairs
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped
from tests.support.reference import reference_run

STEPS = 3
LAYOUTS = {  # name: (parallel, microbatches)
    "dp2": ({"dp": 2}, 1),
    "dp2-zero3": ({"dp": 2, "zero": 3}, 1),
    "tp2": ({"tp": 2}, 1),
    "tp2-sp": ({"tp": 2, "sequence_parallel": True}, 1),
    "dp2-microbatches2": ({"dp": 2}, 2),
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return prepare_pairs(tmp_path_factory.mktemp("dpo"))


def _spec(pairs, tmp_path, parallel: dict | None = None, microbatches: int = 1):
    return tiny_spec(pairs, tmp_path, parallel={**(parallel or {}), "device": "cpu"},
                     model={"init_std": 0.1, "lora": {"rank": 4, "alpha": 8}},
                     train={"steps": STEPS, "microbatches": microbatches, "objective": "dpo", "dpo_beta": 0.5})


@pytest.fixture(scope="module")
def reference(pairs, tmp_path_factory):
    return reference_run(_spec(pairs, tmp_path_factory.mktemp("ref")), STEPS)


@pytest.fixture(scope="module")
def runs(pairs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo-parity")
    return run_grouped({name: _spec(pairs, tmp / name, parallel, mb) for name, (parallel, mb) in LAYOUTS.items()})


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dpo_layout_matches_single_process_reference(name, reference, runs):
    losses, grad_norms = reference
    run = ran(runs, name)
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4)


def test_the_first_step_is_log_2_and_the_policy_moves(reference):
    """Not a vacuous comparison: LoRA's B starts at zero (loss log 2), and the pairs pull the loss off it."""
    losses, _ = reference
    assert losses[0] == pytest.approx(0.6931471805599453, abs=1e-6)
    assert abs(losses[-1] - losses[0]) > 1e-3


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_reports_the_global_batch_reward_figures(name, runs):
    """Every rank of every layout reports the same figures (the global batch's), starting at zero rewards."""
    base = ran(runs, "dp2").field("dpo")[0]
    for figures in ran(runs, name).field("dpo").values():
        assert [sorted(f) for f in figures] == [["chosen_reward", "rejected_reward", "reward_accuracy",
                                                 "reward_margin"]] * STEPS
        for mine, theirs in zip(figures, base):
            assert mine == pytest.approx(theirs, abs=1e-5)
    assert base[0] == {"reward_accuracy": 0.0, "chosen_reward": 0.0, "rejected_reward": 0.0, "reward_margin": 0.0}
    assert base[-1]["reward_margin"] != 0.0
