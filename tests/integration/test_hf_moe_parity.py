"""A Qwen3-MoE checkpoint (``model.init_from``) trains as the single-process reference does on every parallel axis
that cuts its experts or its layers, without Ray (tests/support/parity_harness.py; fp32, CPU, 3 steps, 1e-4).

What each layout must get right for it: under ep each rank reads only its half of the experts from their
per-expert tensors (rows offset by ``Experts.first``), under ``parallel.expert_tp`` only its tp slice of each
expert's hidden; ZeRO-3 shards each expert stack's rows over dp, and a rank
reads its shard's experts; tp replicates the MoE feed-forward and shards the dense layers and attention; pp cuts
between a dense and an MoE layer (``decoder_sparse_step`` 2: layers 1 and 3 have experts).
"""

from __future__ import annotations

import pytest

from tests.support.hf import save_hf_family
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped
from tests.support.reference import reference_run

STEPS = 3
LAYOUTS = {"ep2": {"dp": 2, "ep": 2}, "dp2-zero3": {"dp": 2, "zero": 3}, "tp2": {"tp": 2}, "pp2": {"pp": 2},
           # transformers' balance loss pooled over the layers (model.moe.balance_loss), as the example runs it and
           # under ZeRO-3, whose resharded routers the pooled loss reaches from the last MoE layer
           "pooled-ep2-zero2": {"dp": 2, "ep": 2, "zero": 2}, "pooled-dp2-zero3": {"dp": 2, "zero": 3},
           # expert tensor parallelism: each rank reads its experts' hidden slice (w1/w3 columns, w2 rows)
           "etp-dp2-ep2-tp2": {"dp": 2, "ep": 2, "tp": 2, "expert_tp": True}}


@pytest.fixture(scope="module")
def cases(token_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-moe-parity")
    # the tiny job's shape (d_ff 64: the dense layers' intermediate_size), 8 experts 24 wide, top-2
    src = save_hf_family(root / "qwen3_moe", "qwen3_moe", intermediate_size=64)
    return {name: tiny_spec(token_data, root / name, parallel={**parallel, "device": "cpu"},
                            model={"init_from": str(src), **({"moe": {"balance_loss": "pooled", "aux_loss_weight": 0.1}}
                                                             if name.startswith("pooled") else {})},
                            train={"steps": STEPS})
            for name, parallel in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs(cases):
    return run_grouped(cases)


def test_the_checkpoint_is_a_qwen3_moe(cases):
    moe = cases["ep2"].model.moe
    assert (cases["ep2"].model.hf_model_type, moe.experts, moe.d_expert, moe.every) == ("qwen3_moe", 8, 24, 2)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_the_reference(name, cases, runs):
    run = ran(runs, name)
    losses, grad_norms = reference_run(cases[name], STEPS)
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4)
