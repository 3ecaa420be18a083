"""Expert parallelism without processes: replica peers, spec checks, local experts' initial rows, which stacks a
checkpoint saves whole, the planner's share of the experts and the layout picker's ep."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from orchestrator.errors import SpecError
from orchestrator.planning import layout_search as ls
from orchestrator.planning import time_model as tm
from orchestrator.planning.estimate import peak_rank
from orchestrator.planning.layout_picker import pick_layout
from orchestrator.spec import JobSpec
from orchestrator.spec.sections import dp_replicas_mirror
from workers.contract.grid import Grid
from workers.model.config import ModelConfig
from workers.model.meta_init import build_full, materialize
from workers.model.moe import Experts
from workers.model.registry import family
from workers.parallel.expert_parallel import experts_modules, keep_rows
from workers.state import expert_stacks

MOE_CFG = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, seq_len=8, moe={"experts": 4})


def test_replica_peer_holds_the_same_experts_when_a_replica_does():
    grid = Grid(dp=4, ep=2, pp=2)
    for rank in grid.ranks():
        peer = grid.replica_peer(rank)
        assert grid.same_state(peer, rank) and grid.coords(peer).dp != grid.coords(rank).dp
    flat = Grid(dp=2, ep=2)  # every dp rank holds other experts: the next replica keeps a shipped copy
    assert flat.replica_peer(0) == 1 and not flat.same_state(0, 1)


def _job(parallel: dict[str, Any], moe: dict | None = None, **model: Any) -> dict[str, Any]:
    return {"data": {"path": "data/tiny"}, "parallel": parallel,
            "model": {**model, **({"moe": moe} if moe is not None else {})}}


def test_only_data_parallel_replicas_holding_the_same_experts_mirror():
    mirror = JobSpec.from_dict(_job({"dp": 4, "ep": 2}, {"experts": 4}))
    assert dp_replicas_mirror(mirror.parallel, mirror.optim)
    flat = JobSpec.from_dict(_job({"dp": 2, "ep": 2}, {"experts": 4}))
    assert not dp_replicas_mirror(flat.parallel, flat.optim)


@pytest.mark.parametrize(("parallel", "moe", "field", "value", "fix"), [
    ({"dp": 4, "ep": 3}, {"experts": 6}, "parallel.ep", 3, "1, 2, 4"),
    ({"dp": 4, "ep": 4}, {"experts": 6}, "parallel.ep", 4, "1, 2, 3, 6"),
    ({"dp": 2, "ep": 2}, None, "parallel.ep", 2, "model.moe"),
    ({"dp": 2, "ep": 2, "dp_sync": "ps"}, {"experts": 4}, "parallel.dp_sync", "ps", "allreduce"),
])
def test_bad_expert_parallelism_is_refused_naming_field_value_and_fix(parallel, moe, field, value, fix):
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict(_job(parallel, moe))
    assert (info.value.field, info.value.value) == (field, value) and fix in info.value.fix


def test_zero1_with_expert_parallelism_is_accepted():
    job = JobSpec.from_dict(_job({"dp": 4, "ep": 2, "zero": 1}, {"experts": 4}))  # experts sliced over edp
    assert (job.parallel.zero, job.parallel.ep) == (1, 2)


def _local_model(index: int, ep: int) -> torch.nn.Module:
    with torch.device("meta"):
        model = family("gpt").build(MOE_CFG)
    for experts in experts_modules(model):
        keep_rows(experts, index, ep)
    return materialize(model, 5, MOE_CFG, torch.device("cpu"))


def test_each_rank_materialises_its_rows_of_the_full_expert_stack():
    whole = build_full(MOE_CFG, seed=5)
    for index in range(2):
        part = _local_model(index, 2)
        for name, p in part.named_parameters():
            full = whole.get_parameter(name)
            rows = slice(2 * index, 2 * index + 2) if ".experts." in name else slice(None)
            assert torch.equal(p, full[rows]), name
    assert any(isinstance(m, Experts) and m.num_local == 2 for m in part.modules())


def test_checkpoints_save_every_split_expert_stack_at_its_global_expert_count():
    """Each stacked weight an ep rank holds rows of is named with the full stack's expert count (DCP's global
    shape); at ep=1 nothing is split, so nothing is re-placed."""
    part = _local_model(1, 2)
    stacks = expert_stacks.sharded_experts([part])
    assert stacks and {stack.shape[0] for stack in stacks.values()} == {4}
    assert all(stack.hidden_dim is None for stack in stacks.values())  # whole experts: no tp split
    assert all(stack.shape[1:] == part.get_parameter(name).shape[1:] for name, stack in stacks.items())
    assert all(part.get_parameter(name).shape[0] == 2 for name in stacks)
    assert expert_stacks.sharded_experts([_local_model(0, 1)]) == {}


def _moe_plan(**parallel: Any) -> JobSpec:
    """A 1.3B-ish MoE GPT (8 experts in every other block) as the planner sees it."""
    raw = _job({"device": "cuda", **parallel}, {"experts": 8, "every": 2}, d_model=1024, n_layers=8, n_heads=8,
               d_ff=4096, seq_len=512)
    return JobSpec.from_dict({**raw, "train": {"global_batch_size": 64}})


def test_planner_divides_routed_experts_and_their_state_by_ep():
    routed = 4 * 8 * 2 * 1024 * 4096  # 4 MoE blocks x 8 experts x GPT's two matrices
    one, four = peak_rank(_moe_plan(dp=8)), peak_rank(_moe_plan(dp=8, ep=4))
    assert one.params - four.params == routed - routed // 4
    # weights, gradients and Adam's two moments in fp32: 16 bytes per parameter not held any more
    assert one.state.persistent - four.state.persistent == 16 * (routed - routed // 4)
    assert four.buffer_bytes - one.buffer_bytes == 4 * (64 // 8) * 512 * 2 * 1024 * 4  # all-to-all buffers, top-2


def test_layout_picker_splits_the_experts_before_sharding_everything():
    # just below what every ep=1 layout of the search needs (ZeRO-3 included: each rank still gathers a whole MoE
    # block's 8 experts), which the search prices with the estimate's expert terms
    spec = _moe_plan(dp=8).with_overrides(["memory.headroom=0"])
    unlimited = ls.search(ls.Shape.of(spec), 8, tm.gpu("H100").with_overrides(memory=10**13), cps=[1],
                          even_splits=True).best
    limit = min(c.peak for c in unlimited if c.layout.ep == 1) - 1
    choice = pick_layout(spec, nodes=1, gpus_per_node=8, gpu_mem=limit)
    p = choice.spec.parallel
    assert p.ep > 1 and f"ep={p.ep}" in choice.reason  # the experts split rather than ep=1, which does not fit
    assert peak_rank(choice.spec).total_bytes <= limit
