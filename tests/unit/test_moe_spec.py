"""`model.moe` is refused before anything starts when it cannot work, naming the field, the value and the fix."""

from __future__ import annotations

import pytest

from orchestrator import JobSpec
from orchestrator.errors import SpecError


def _job(moe: dict, **sections) -> JobSpec:
    model = {"d_model": 32, "n_layers": 2, "n_heads": 4, "moe": moe}
    return JobSpec.from_dict({"model": model, "data": {"path": "/data"}, **sections})


@pytest.mark.parametrize(("moe", "field", "words"), [
    ({"experts": 4, "top_k": 5}, "model.moe.top_k", "at most 4"),
    ({"capacity_factor": 0.0}, "model.moe.capacity_factor", "> 0"),
    ({"capacity_factor": -1.0}, "model.moe.capacity_factor", "> 0"),
    ({"router": "hash"}, "model.moe.router", "expert_choice"),
    ({"every": 0}, "model.moe.every", ">= 1"),
    ({"every": 3}, "model.moe.every", "at most 2"),
    ({"experts": 1}, "model.moe.experts", ">= 2"),
    ({"router": "switch", "top_k": 2}, "model.moe.top_k", "top_k: 1"),
    ({"router": "gshard", "top_k": 1}, "model.moe.top_k", "top_k: 2"),
    ({"router": "expert_choice", "top_k": 2}, "model.moe.top_k", "capacity_factor"),
    ({"router": "switch", "bias_balancing": True}, "model.moe.bias_balancing", "router: topk"),
    ({"group": "batch"}, "model.moe.group", "sequence"),
])
def test_bad_moe_settings_name_field_value_and_fix(moe, field, words):
    with pytest.raises(SpecError) as err:
        _job(moe)
    assert err.value.field == field and words in str(err.value)


def test_moe_with_tensor_parallel_is_accepted():
    job = _job({}, parallel={"tp": 2})  # the MoE feed-forward is replicated over tp (gpt_parallel.moe_style)
    assert job.parallel.tp == 2 and job.model.moe is not None


def test_router_defaults_give_each_paper_its_k():
    assert _job({"router": "switch"}).model.moe.k == 1
    assert _job({"router": "gshard"}).model.moe.k == 2
    assert _job({"router": "topk", "top_k": 3}).model.moe.k == 3
    assert _job({"every": 2}).worker_dict()["model"]["moe"]["every"] == 2
