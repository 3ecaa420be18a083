"""gpt-oss under context parallelism (issue 49, 50): a tiny random ``GptOssForCausalLM`` (alternating sliding-window
and full layers, attention sinks, its biased experts) loaded through ``model.init_from`` trains at cp2 with the
ring, the all-gather and Ulysses kernels (the sinks go into each kernel's running softmax; Ulysses deals them out
with the query heads) without Ray (tests/support/parity_harness.py; fp32, CPU): the first step's loss and gradient
norm equal transformers' to 1e-5, and 3 steps follow the single-process reference to 1e-4. The tiny job's 32-token
sequences are 16 a rank, the window 6: windowed tiles cross the zigzag chunks' edges."""

from __future__ import annotations

import pytest

from tests.support.hf import assert_first_step_then_reference, init_from_layouts, save_hf_gpt_oss
from tests.support.parity_harness import ran

STEPS = 3
LAYOUTS = {f"cp2-{impl}": {"cp": 2, "cp_impl": impl} for impl in ("ring", "allgather", "ulysses")}


@pytest.fixture(scope="module")
def layouts(token_data, tmp_path_factory):
    """(specs, checkpoints written, runs); the balance loss off, as transformers trains (no output_router_logits)."""
    _, src = save_hf_gpt_oss(tmp_path_factory.mktemp("gpt-oss-hf") / "hf")
    return init_from_layouts(src, token_data, tmp_path_factory, LAYOUTS, STEPS, model={"moe": {"aux_loss_weight": 0.0}})


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gpt_oss_at_cp2_starts_at_transformers_and_follows_the_reference(name, layouts):
    specs, _, runs = layouts
    spec = specs[name]
    assert spec.parallel.cp == 2 and spec.model.arch == "gpt_oss"
    assert spec.model.attention_types[:2] == ["sliding_attention", "full_attention"]
    assert_first_step_then_reference(ran(runs, name), spec, spec.model.init_from, STEPS)
