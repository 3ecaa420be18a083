"""gpt-oss (``model.arch: gpt_oss``) from a tiny random ``GptOssForCausalLM`` through ``model.init_from``, without Ray
(tests/support/parity_harness.py; fp32, CPU): the first step's loss is transformers' to 1e-5 at one process, tp2
(the sinks sharded with their heads), pp2 and dp2 x ep2 (its biased experts split over ranks), and 4 steps follow
the single-process reference to 1e-4. The model itself is checked against transformers in
tests/unit/test_gpt_oss.py."""

from __future__ import annotations

import pytest

from tests.support.hf import save_hf_gpt_oss, transformers_first_step
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped
from tests.support.reference import assert_follows_reference

STEPS = 4
LAYOUTS = {"one": ({}, {}), "tp2": ({"tp": 2}, {}), "pp2": ({"pp": 2}, {"microbatches": 2}),
           "dp2-ep2": ({"dp": 2, "ep": 2}, {})}


@pytest.fixture(scope="module")
def cases(token_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss-parity")
    _, src = save_hf_gpt_oss(root / "hf")
    return {name: tiny_spec(token_data, root / name, parallel={**parallel, "device": "cpu"},
                            model={"init_from": str(src), "n_kv_heads": 2, "moe": {"aux_loss_weight": 0.01}},
                            train={"steps": STEPS, **train})
            for name, (parallel, train) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs(cases):
    return run_grouped(cases)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_init_from_starts_at_transformers_loss_and_follows_the_reference(name, cases, runs):
    run, spec = ran(runs, name), cases[name]
    assert spec.model.arch == "gpt_oss" and spec.model.attention_types[:2] == ["sliding_attention", "full_attention"]
    loss, _ = transformers_first_step(spec, spec.model.init_from)
    assert run.losses[0] == pytest.approx(loss, abs=1e-5)
    assert_follows_reference(run, spec, STEPS)
