"""Qwen3- and Qwen2-shaped models (raymesh's Llama with ``head_dim``/``qk_norm`` or ``qkv_bias``) reproduce the
single-process reference on every parallel axis, without Ray (tests/support/parity_harness.py; fp32, CPU, 1e-4).

What each axis must get right for these fields: tp shards q/k/v/o at n_heads * head_dim, the biases with their
columns and replicates the per-head q/k norms (their gradient summed over tp); pp cuts blocks holding them; ZeRO-3
shards them as any parameter; cp's ring kernel takes heads of head_dim width.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped
from tests.support.reference import reference_run

STEPS = 3
# the tiny job's d_model 32 over 4 heads (2 K/V heads): Qwen3's heads 16 wide (not 8), tied, normed per head
SHAPES = {
    "qwen3": {"arch": "llama", "n_kv_heads": 2, "head_dim": 16, "qk_norm": True, "tie_embeddings": True,
              "hf_model_type": "qwen3"},
    "qwen2": {"arch": "llama", "n_kv_heads": 2, "qkv_bias": True, "hf_model_type": "qwen2"},
}
# (parallel, model overrides): a tied head cannot span pipeline stages (refused), so pp2 unties it
LAYOUTS = {"tp2": ({"tp": 2}, {}), "pp2": ({"pp": 2}, {"tie_embeddings": False}),
           "dp2-zero3": ({"dp": 2, "zero": 3}, {}), "cp2-ring": ({"cp": 2, "cp_impl": "ring"}, {})}


@pytest.fixture(scope="module")
def cases(token_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-family-parity")
    return {f"{shape}-{name}": tiny_spec(token_data, root / f"{shape}-{name}", parallel={**parallel, "device": "cpu"},
                                         model={**model, **changes}, train={"steps": STEPS},
                                         checkpoint={"dir": str(root / f"{shape}-{name}" / "ckpt")})
            for shape, model in SHAPES.items() for name, (parallel, changes) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs(cases):
    # the tp layout saves its final state, read back below: the per-head norms' own weights prove their gradient
    # is summed over tp (a rank's heads alone move them less than the whole model's do)
    return run_grouped(cases, checkpoints={"qwen3-tp2": str(_final(cases["qwen3-tp2"]))})


def _final(spec):
    return Path(spec.checkpoint.dir) / f"step-{STEPS:08d}"


@pytest.mark.parametrize("name", [f"{s}-{n}" for s in SHAPES for n in LAYOUTS])
def test_layout_matches_the_reference(name, cases, runs):
    run = ran(runs, name)
    losses, grad_norms = reference_run(cases[name], STEPS)
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4)


def test_tp_steps_the_per_head_norms_as_the_reference_does(cases, runs, tmp_path):
    """After the tp2 run, q_norm/k_norm (replicated, each rank norming its own heads) equal the reference's."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ran(runs, "qwen3-tp2")
    final = {}
    reference_run(cases["qwen3-tp2"], STEPS, after_step=lambda model, step: final.update(
        {k: v.detach().clone() for k, v in model.state_dict().items()}))
    dcp_to_torch_save(str(_final(cases["qwen3-tp2"])), str(tmp_path / "state.pt"))
    saved = torch.load(tmp_path / "state.pt", weights_only=False)["model"]
    norms = [k for k in final if k.endswith(("q_norm.weight", "k_norm.weight"))]
    assert norms and all(not torch.equal(final[k], torch.ones_like(final[k])) for k in norms)  # they moved
    for key in norms:
        torch.testing.assert_close(saved[key], final[key], rtol=0, atol=1e-5, msg=key)
