"""Context-parallel layouts reproduce the single-process reference (fp32, CPU, 1e-4 relative), issue 16.

Each layout splits every sequence over cp ranks (zigzag chunks), embeds and rotates at global positions,
joins the shares in attention with the kernel ``parallel.cp_impl`` names, and reduces gradients over dp x cp;
the losses and global gradient norms must equal one process training the whole sequence. Ranks are spawned
processes over gloo (tests/support/parity_harness.py, no Ray); 3 steps of the tiny model each, the reference
computed once per family.
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped, run_layout
from tests.support.reference import reference_run

STEPS = 3
FAMILIES = {
    "gpt-learned": {"positions": "learned"},  # learned position embeddings, read at global positions
    "llama-gqa": {"arch": "llama", "n_kv_heads": 2},  # rotary at global positions; 1 K/V head per tp rank
}
LAYOUTS = {  # name: (family, parallel)
    "cp2-dp2-ring": ("gpt-learned", {"cp": 2, "dp": 2, "cp_impl": "ring"}),
    # ZeRO-1's distributed optimizer slices over dp x cp (here cp alone) inside each tp shard
    "cp2-tp2-ulysses-zero1": ("llama-gqa", {"cp": 2, "tp": 2, "cp_impl": "ulysses", "zero": 1}),
    "pp2-cp2-dp2-allgather": ("llama-gqa", {"pp": 2, "cp": 2, "dp": 2, "cp_impl": "allgather"}),
}


def _spec(token_data, tmp_path, family: str, parallel: dict | None = None):
    return tiny_spec(token_data, tmp_path, parallel={**(parallel or {}), "device": "cpu"},
                     model=FAMILIES[family], train={"steps": STEPS})


@pytest.fixture(scope="module")
def references(token_data, tmp_path_factory):
    """Per-step (losses, grad norms) of one process on the whole sequence, per family, computed once."""
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            cache[family] = reference_run(_spec(token_data, tmp_path_factory.mktemp(family), family), STEPS)
        return cache[family]
    return get


def _activation_spec(token_data, tmp_path, cp: int):
    """One step of a 512-token sequence with ring attention over ``cp`` ranks, its activation bytes measured."""
    return tiny_spec(token_data, tmp_path / f"cp{cp}", parallel={"cp": cp, "cp_impl": "ring", "device": "cpu"},
                     model={"seq_len": 512}, memory={"measure": True},
                     train={"steps": 1, "global_batch_size": 2, "microbatches": 1})


@pytest.fixture(scope="module")
def specs(token_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp-parity")
    out = {name: _spec(token_data, tmp / name, family, parallel) for name, (family, parallel) in LAYOUTS.items()}
    return {**out, **{f"activations-cp{cp}": _activation_spec(token_data, tmp, cp) for cp in (1, 4)}}


@pytest.fixture(scope="module")
def runs(specs):
    """Every layout's ranks, those of one size in one spawn (``run_grouped``)."""
    return run_grouped(specs)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_layout_matches_single_process_reference(name, references, runs):
    family, _ = LAYOUTS[name]
    run = ran(runs, name)
    losses, grad_norms = references(family)
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4)


def test_cp2_checkpoint_resumes_at_cp1_on_the_reference_curve(references, token_data, tmp_path):
    """DCP reshards a cp=2 save to one rank: cp ranks hold replicated weights and the data position counts
    whole samples, so step 3 at cp=1 continues the reference's curve."""
    losses, grad_norms = references("gpt-learned")
    saved = str(tmp_path / "cp2-step2")
    cp2 = _spec(token_data, tmp_path / "cp2", "gpt-learned", {"cp": 2, "cp_impl": "ring"})
    first = run_layout(cp2.worker_dict(), 2, STEPS - 1, checkpoint=saved)
    assert first.losses == pytest.approx(losses[:-1], rel=1e-4)
    single = _spec(token_data, tmp_path / "cp1", "gpt-learned")
    resumed = run_layout(single.worker_dict(), 1, 1, resume=saved)
    assert resumed.losses == pytest.approx(losses[-1:], rel=1e-4)
    assert resumed.grad_norms == pytest.approx(grad_norms[-1:], rel=1e-4)


def test_activation_bytes_per_rank_at_cp4_are_a_quarter_of_cp1s(specs, runs):
    """Bytes saved for backward (the trainer's ActivationMeter, one step of a 512-token sequence) on each
    ring-attention cp=4 rank are within 10% of a quarter of one rank's at cp=1; the planner predicts them."""
    from orchestrator.planning.estimate import peak_rank

    (whole,) = ran(runs, "activations-cp1").activation_bytes.values()
    shares, spec = ran(runs, "activations-cp4").activation_bytes, specs["activations-cp4"]
    assert len(shares) == 4
    for share in shares.values():
        assert share == pytest.approx(whole / 4, rel=0.10)
    assert peak_rank(spec).activation_bytes == pytest.approx(max(shares.values()), rel=0.01)
