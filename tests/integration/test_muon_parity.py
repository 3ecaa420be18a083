"""`optim.name: muon` on parallel layouts reproduces the single-process reference (fp32, CPU, 1e-4 relative), whose
Muon and AdamW are PyTorch's own built by hand (tests/support/reference.py): losses and global gradient norms.

Each layout hands Muon its matrices differently: ZeRO-0 plain tensors (DDP; each rank orthogonalises its share and
broadcasts it), ZeRO-3 FSDP2's dim-0 DTensor shards and TP's row and column shards (each gathered whole on its owner
rank, the update reduce-scattered: ``WholeMatrixMuon``), and a pipeline's stages, each stepping its own matrices.
The combinations: expert parallelism (the router, replicated over ep, is Muon's; the expert stacks AdamW's), at
ZeRO-0 and ZeRO-3 on a MoE model against its own reference; PipeDream-2BW (weight stashing: the hybrid steps the
live weights between microbatches, the stash keeps copies) against the paper's update rule with Muon
(``reference_versioned``); bf16 under FSDP2's policy against the policy written out (``reference_bf16_fsdp``).
Ranks are spawned processes over gloo (tests/support/parity_harness.py, no Ray), every layout at world size 2 in one
spawn (ZeRO-3 × tp in a second, of 4), 3 steps each; each reference is computed once.
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped
from tests.support.reference import reference_bf16_fsdp, reference_run, reference_versioned

STEPS = 3
OPTIM = {"name": "muon", "lr": 0.01, "weight_decay": 0.1}
LAYOUTS = {
    "dp2-zero0": {"dp": 2},
    "dp2-zero3": {"dp": 2, "zero": 3},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    # FSDP2 over dp on top of TP: a 2-D mesh, whose gather and reduce-scatter go over both dims (a second spawn, of 4)
    "dp2-tp2-zero3": {"dp": 2, "tp": 2, "zero": 3},
}
# Newton-Schulz runs in bf16, so a last-bit difference in a gradient's reduction order (tp's partial sums; measured:
# tp2 6e-5 on the third step's gradient norm, losses within 5e-6) can flip a rounding it then amplifies; tp under
# FSDP2 adds dp's reduction order to it (1.02e-4 measured, losses within 4.2e-6: a misplaced shard moves the loss)
GRAD_NORM_REL = {"dp2-tp2-zero3": 2e-4}
MOE = {"n_layers": 2, "moe": {"experts": 4, "group": "sequence", "router": "topk"}}
EP_LAYOUTS = {"ep2-zero0": {"dp": 2, "ep": 2}, "ep2-zero3": {"dp": 2, "ep": 2, "zero": 3}}
EVERY = 2  # 2BW: a weight version every 2 microbatches
SECTIONS = {  # the other combinations: name -> the spec's sections
    "2bw-pp2": {"parallel": {"pp": 2, "pp_schedule": "pipedream_2bw", "pp_2bw_every": EVERY},
                "train": {"microbatches": 4}, "optim": {"grad_clip": 0.0}},
    "bf16-dp2-zero3": {"parallel": {"dp": 2, "zero": 3}, "precision": {"dtype": "bf16", "policy": "fsdp"},
                       "train": {"microbatches": 2}},
}


def _spec(token_data, tmp_path, parallel: dict | None = None, model: dict | None = None, **sections):
    train, optim = sections.pop("train", {}), sections.pop("optim", {})
    return tiny_spec(token_data, tmp_path, parallel={**(parallel or {}), "device": "cpu"}, model=model or {},
                     optim={**OPTIM, **optim}, train={"steps": STEPS, **train}, **sections)


@pytest.fixture(scope="module")
def specs(token_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muon-parity")
    return {**{name: _spec(token_data, tmp / name, p) for name, p in LAYOUTS.items()},
            **{name: _spec(token_data, tmp / name, p, MOE) for name, p in EP_LAYOUTS.items()},
            **{name: _spec(token_data, tmp / name, **sections) for name, sections in SECTIONS.items()}}


@pytest.fixture(scope="module")
def reference(token_data, tmp_path_factory):
    return reference_run(_spec(token_data, tmp_path_factory.mktemp("muon-reference")), STEPS)


@pytest.fixture(scope="module")
def runs(specs):
    """Every layout's ranks in one spawn of two (``run_grouped``)."""
    return run_grouped(specs)


def test_the_reference_is_not_adamw(token_data, reference, tmp_path):
    """Not a vacuous comparison: Muon moves the losses away from AdamW's at the same rate."""
    adamw = tiny_spec(token_data, tmp_path, optim={"lr": 0.01, "weight_decay": 0.1}, train={"steps": STEPS})
    assert reference_run(adamw, STEPS)[0] != pytest.approx(reference[0], rel=1e-4)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_layout_matches_single_process_reference(name, reference, runs):
    run = ran(runs, name)
    losses, grad_norms = reference
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=GRAD_NORM_REL.get(name, 1e-4))


@pytest.mark.parametrize("name", list(EP_LAYOUTS))
def test_muon_under_expert_parallelism_matches_the_moe_reference(name, specs, runs, token_data, tmp_path):
    losses, grad_norms = reference_run(_spec(token_data, tmp_path, model=MOE), STEPS)
    run = ran(runs, name)
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4)


def test_muon_under_pipedream_2bw_follows_the_update_rule(specs, runs):
    """W(t+1) = W(t) - Muon/AdamW update of grad f(W(t-1)): the stash's versions and the hybrid's in-place step
    (with its momentum) agree."""
    rule = reference_versioned(specs["2bw-pp2"], STEPS, lambda stage, n: max(0, n // EVERY - 1), every=EVERY)
    assert ran(runs, "2bw-pp2").losses == pytest.approx(rule, rel=1e-4)


def test_muon_under_the_fsdp_bf16_policy_matches_the_policy_written_out(specs, runs):
    """Norms to 2e-4, not 1e-4: FSDP2 and the reference sum the ranks' bf16 gradients in another order, and
    Newton-Schulz rounds its input to bf16, so a last-bit difference flips some of its roundings (seen: 1.1e-4 at
    step 3; AdamW, which does not round its input, stays within 1e-4 in tests/integration/test_mixed_precision.py)."""
    losses, grad_norms = reference_bf16_fsdp(specs["bf16-dp2-zero3"], STEPS)
    run = ran(runs, "bf16-dp2-zero3")
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=2e-4)
