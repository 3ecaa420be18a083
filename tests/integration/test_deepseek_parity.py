"""DeepSeek-V3 (``model.arch: deepseek_v3``) trains as the single-process reference does where its experts and its
layers are cut, without Ray (tests/support/parity_harness.py; fp32, CPU, 3 steps, 1e-4): expert parallelism over
the sigmoid, group-limited router with the balancing bias (each rank moves the bias by the load summed over dp),
ZeRO-3 over the expert stacks, and pipeline stages cut between the dense first layer and the MoE ones. The model
itself is checked against transformers' DeepseekV3ForCausalLM in tests/unit/test_deepseek.py."""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped
from tests.support.reference import reference_run

STEPS = 3
MODEL = {"arch": "deepseek_v3", "d_model": 32, "n_heads": 4, "d_ff": 48, "q_lora_rank": 16, "kv_lora_rank": 12,
         "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, "dense_layers": 1,
         "moe": {"experts": 8, "top_k": 2, "router": "sigmoid", "groups": 4, "top_groups": 2, "gate_scale": 2.5,
                 "shared_experts": 1, "d_expert": 16, "bias_balancing": True, "bias_update_rate": 0.01,
                 "aux_loss_weight": 0.001}}
LAYOUTS = {"dp2-ep2": ({"dp": 2, "ep": 2}, {}), "dp2-zero3": ({"dp": 2, "zero": 3}, {}),
           "pp2": ({"pp": 2}, {"microbatches": 2}), "dp2-ep2-pp2": ({"dp": 2, "ep": 2, "pp": 2}, {"microbatches": 2})}


@pytest.fixture(scope="module")
def cases(token_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-parity")
    return {name: tiny_spec(token_data, root / name, parallel={**parallel, "device": "cpu"}, model=MODEL,
                            train={"steps": STEPS, **train})
            for name, (parallel, train) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs(cases):
    return run_grouped(cases)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_the_reference(name, cases, runs):
    run = ran(runs, name)
    losses, grad_norms = reference_run(cases[name], STEPS)
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4)
