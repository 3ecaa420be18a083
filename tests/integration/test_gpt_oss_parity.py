"""gpt-oss (``model.arch: gpt_oss``) from a tiny random ``GptOssForCausalLM`` through ``model.init_from``, without Ray
(tests/support/parity_harness.py; fp32, CPU): the first step's loss and gradient norm are transformers' to 1e-5 at
one process, tp2 (the sinks sharded with their heads), pp2, dp2 x ep2 (its biased experts split over ranks) and cp2
with the ring, all-gather and Ulysses kernels (the sinks in each kernel's running softmax; Ulysses deals them out
with the query heads; 16 tokens a rank against a 6-token window), and 4 steps follow the single-process reference
to 1e-4; ``export-hf`` of the tp2 run's checkpoint writes exactly the
tensors DCP holds, fused as GptOssForCausalLM keeps them, and ``from_pretrained`` reads them back. The model itself
is checked against transformers in tests/unit/test_gpt_oss.py."""

from __future__ import annotations

import pytest
import torch

from orchestrator.spec.lora import export_hf_weights
from tests.support.hf import assert_first_step_then_reference, dcp_model_tensors, init_from_layouts, save_hf_gpt_oss
from tests.support.parity_harness import ran
from workers.model import gpt_oss

STEPS = 4
LAYOUTS = {"one": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "dp2-ep2": {"dp": 2, "ep": 2},
           **{f"cp2-{impl}": {"cp": 2, "cp_impl": impl} for impl in ("ring", "allgather", "ulysses")}}


@pytest.fixture(scope="module")
def layouts(token_data, tmp_path_factory):
    """(specs, checkpoints written, runs); the balance loss off, as transformers trains (no output_router_logits),
    so the first step's gradients are comparable too."""
    _, src = save_hf_gpt_oss(tmp_path_factory.mktemp("gpt-oss-hf") / "hf")
    return init_from_layouts(src, token_data, tmp_path_factory, LAYOUTS, STEPS, model={"moe": {"aux_loss_weight": 0.0}})


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_init_from_starts_at_transformers_and_follows_the_reference(name, layouts):
    specs, _, runs = layouts
    spec = specs[name]
    assert spec.model.arch == "gpt_oss" and spec.model.attention_types[:2] == ["sliding_attention", "full_attention"]
    assert_first_step_then_reference(ran(runs, name), spec, spec.model.init_from, STEPS)


def test_export_hf_writes_the_checkpoint_as_gpt_oss_holds_it(layouts, tmp_path):
    from safetensors.torch import load_file
    from transformers import GptOssForCausalLM

    specs, written, _ = layouts
    out = export_hf_weights(specs["tp2"], str(written["tp2"]), str(tmp_path / "exported"))
    held = gpt_oss.to_hf_state(dcp_model_tensors(written["tp2"], tmp_path / "c.pt"))
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == set(held)
    for key, value in exported.items():
        assert torch.equal(value, held[key]), key
    reloaded = GptOssForCausalLM.from_pretrained(out).state_dict()
    for key, value in held.items():
        assert torch.equal(reloaded[key], value), key
