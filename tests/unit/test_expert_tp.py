"""Expert tensor parallelism's pieces without processes: the refusals, the slices, the sum, and the planner.

``parallel.expert_tp`` splits each routed expert's hidden over tp (``workers.parallel.expert_parallel.
split_hidden``): the slices must be the full model's columns (w1, w3) and rows (w2) as meta-device init draws
them, their outputs must sum to the whole expert's (dropout included), and the planner must count 1 / (ep · tp)
of the routed experts per rank. The 4-rank parity is tests/integration/test_expert_tp_parity.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from orchestrator.errors import SpecError
from orchestrator.planning.estimate import peak_rank
from orchestrator.spec import JobSpec
from workers.model.config import ModelConfig
from workers.model.meta_init import build_full, materialize
from workers.model.moe import Experts, mix
from workers.model.registry import family
from workers.parallel.expert_parallel import experts_modules, keep_rows, split_hidden

CFG = ModelConfig(arch="llama", vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, seq_len=8,
                  moe={"experts": 4, "d_expert": 12})


def _job(parallel: dict, moe: dict | None = None, **model) -> JobSpec:
    model = {"d_model": 32, "n_layers": 2, "n_heads": 4, **model, "moe": {"experts": 4, **(moe or {})}}
    return JobSpec.from_dict({"model": model, "data": {"path": "/data"}, "parallel": parallel})


@pytest.mark.parametrize(("parallel", "moe", "model", "field", "fix"), [
    ({"dp": 2, "ep": 2, "expert_tp": True}, {}, {}, "parallel.tp", "parallel.tp > 1"),
    ({"tp": 2, "expert_tp": True}, {}, {}, "parallel.ep", "parallel.ep > 1"),
    ({"dp": 2, "ep": 2, "tp": 2, "expert_tp": True}, {"d_expert": 15}, {}, "model.moe.d_expert", "multiple of 2"),
])
def test_expert_tp_where_it_cannot_split_is_refused_naming_field_value_and_fix(parallel, moe, model, field, fix):
    with pytest.raises(SpecError) as info:
        _job(parallel, moe, **model)
    assert info.value.field == field and fix in info.value.fix and "parallel.expert_tp" in info.value.fix


def test_expert_tp_with_tp_and_ep_is_accepted():
    job = _job({"dp": 2, "ep": 2, "tp": 2, "expert_tp": True})
    assert job.parallel.expert_tp and job.parallel.world_size == 4


def _held(ep_index: int, ep: int, tp_index: int, tp: int) -> torch.nn.Module:
    """A materialised Llama MoE holding ep rank ``ep_index``'s experts, tp rank ``tp_index``'s hidden slice."""
    with torch.device("meta"):
        model = family("llama").build(CFG)
    for experts in experts_modules(model):
        keep_rows(experts, ep_index, ep)
        split_hidden(experts, tp_index, tp)
    return materialize(model, 5, CFG, torch.device("cpu"))


def test_each_tp_rank_holds_its_columns_and_rows_of_the_full_model():
    full = dict(build_full(CFG, 5).named_parameters())
    for tp_index in range(2):
        for name, p in _held(1, 2, tp_index, 2).named_parameters():
            whole = full[name]
            if ".experts." in name:
                dim = 1 if name.endswith("w2") else 2
                whole = whole[2:4].narrow(dim, 6 * tp_index, 6)
            assert torch.equal(p, whole), name


def test_slices_outputs_sum_to_the_whole_experts_with_keyed_dropout():
    """Each tp slice's dropout draws its part of the whole hidden's mask (``first_unit``), so the summed slices
    are the whole expert, dropout and all."""
    torch.manual_seed(0)
    whole = Experts(4, 16, 12, swiglu=True, dropout=0.25)
    for p in whole.parameters():
        torch.nn.init.normal_(p)
    x, counts, keys = torch.randn(10, 16), torch.tensor([3, 0, 5, 2]), mix(7, torch.arange(10))
    slices = []
    for index in range(3):
        part = copy.deepcopy(whole)
        split_hidden(part, index, 3)
        slices.append(part.grouped(x, counts, keys))
    assert torch.allclose(sum(slices), whole.grouped(x, counts, keys), atol=1e-5)


def _moe_plan(**parallel) -> JobSpec:
    """A 1.3B-ish MoE GPT (8 experts in every other block) as the planner sees it."""
    model = {"d_model": 1024, "n_layers": 8, "n_heads": 8, "d_ff": 4096, "seq_len": 512,
             "moe": {"experts": 8, "every": 2}}
    return JobSpec.from_dict({"data": {"path": "/data"}, "model": model, "train": {"global_batch_size": 64},
                              "parallel": {"device": "cuda", **parallel}})


def test_planner_counts_one_tp_slice_of_each_ranks_experts():
    routed = 4 * 8 * 2 * 1024 * 4096  # 4 MoE blocks x 8 experts x GPT's two matrices
    whole, split = (peak_rank(_moe_plan(dp=4, ep=4, tp=2, expert_tp=flag)) for flag in (False, True))
    assert whole.params - split.params == routed // 4 - routed // 8
    # weights, gradients and Adam's two moments in fp32 for the half of its experts a rank no longer holds
    assert whole.state.persistent - split.state.persistent == 16 * (routed // 4 - routed // 8)


def test_planner_shards_the_experts_state_over_the_dp_times_cp_ranks_holding_them():
    """With ep carved from dp x cp, a rank's experts are ZeRO-1-sliced over the dp * cp / ep ranks holding them:
    dp=4 x cp=2 holds exactly the weights and state of dp=8 (dense sliced over 8 ranks, experts over 4 holders)."""
    context, flat = peak_rank(_moe_plan(dp=4, cp=2, ep=2, zero=1)), peak_rank(_moe_plan(dp=8, ep=2, zero=1))
    assert context.params == flat.params and context.state == flat.state
