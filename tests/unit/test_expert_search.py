"""The layout search prices expert parallelism: its per-rank expert bytes are the spec estimate's, it picks an ep
that fits where ep=1 does not, and it keeps expert groups inside a node where placement packs them there."""

from __future__ import annotations

import math

import pytest

from orchestrator import JobSpec
from orchestrator.planning import estimate as est
from orchestrator.planning import layout_search as ls
from orchestrator.planning import time_model as tm
from orchestrator.planning.layout_picker import pick_layout
from orchestrator.runtime.node_order import block_targets, fill_order

MIXTRAL = {"arch": "llama", "d_model": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_ff": 96, "seq_len": 32,
           "moe": {"experts": 8, "top_k": 2, "every": 2}}
DEEPSEEK = {"arch": "deepseek_v3", "d_model": 32, "n_layers": 4, "n_heads": 4, "d_ff": 48, "seq_len": 32,
            "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
            "dense_layers": 1, "moe": {"experts": 8, "top_k": 2, "router": "sigmoid", "groups": 4, "top_groups": 2,
                                       "shared_experts": 1, "d_expert": 16}}


def _job(model: dict, **sections) -> JobSpec:
    return JobSpec.from_dict({"data": {"path": "/tmp/none"}, "run_dir": "/tmp/none", "model": model, **sections})


@pytest.mark.parametrize("model", [MIXTRAL, DEEPSEEK], ids=["every-other", "dense-first"])
@pytest.mark.parametrize("parallel, train, recompute, dtype", [
    ({"dp": 4, "ep": 4, "zero": 1}, {"microbatches": 2}, "none", "bf16"),
    ({"dp": 4, "ep": 2, "zero": 3}, {"microbatches": 1}, "full", "bf16"),
    ({"dp": 2, "ep": 2, "pp": 2, "zero": 0}, {"microbatches": 4}, "selective", "fp32"),
    ({"dp": 2, "ep": 2, "pp": 2, "zero": 2, "pp_schedule": "interleaved_1f1b"}, {"microbatches": 4}, "none", "bf16"),
    ({"dp": 1, "ep": 1, "pp": 2}, {"microbatches": 2}, "none", "bf16"),
])
def test_expert_bytes_per_rank_are_the_estimates(model, parallel, train, recompute, dtype):
    """Every pp rank's in-step peak on the search's path equals the spec estimate's, routed experts split over ep
    and sharded over dp / ep included (``estimate.rank_model_state``), and MoE blocks placed as the model places
    them (DeepSeek's dense first block, Mixtral-style every other block)."""
    spec = _job(model, parallel={**parallel, "device": "cuda"}, train={"global_batch_size": 16, **train},
                memory={"recompute": recompute}, precision={"dtype": dtype})
    ev = ls.Evaluator(ls.Shape.of(spec), tm.gpu("H100"))
    layout = ls.layout_of(spec)
    assert layout.ep == spec.parallel.ep
    for pp_rank in range(spec.parallel.pp):
        want = est.estimate_rank(spec, spec.parallel.grid.rank_of(pp=pp_rank)).total_bytes
        assert ev.rank_peak(layout, pp_rank) == want, pp_rank


def test_expert_bytes_shrink_with_ep_as_the_memory_model_says():
    """Doubling ep halves the routed experts a rank holds: its peak drops by exactly what the estimate drops."""
    peaks, estimates = [], []
    for ep in (1, 2, 4):
        spec = _job(MIXTRAL, parallel={"dp": 4, "ep": ep, "zero": 1, "device": "cuda"},
                    train={"global_batch_size": 16, "microbatches": 1}, precision={"dtype": "bf16"})
        peaks.append(ls.Evaluator(ls.Shape.of(spec), tm.gpu("H100")).rank_peak(ls.layout_of(spec), 0))
        estimates.append(est.peak_rank(spec).total_bytes)
    assert peaks == estimates
    assert peaks[0] > peaks[1] > peaks[2]


def _big_moe() -> JobSpec:
    """Four blocks of 64 experts (1.6B routed parameters a block): at ep=1 even ZeRO-3 over all 16 ranks leaves
    every rank gathering a whole block's experts (the smallest such peak is 9.9 GB), while ep=2 halves that."""
    model = {"arch": "llama", "d_model": 2048, "n_layers": 4, "n_heads": 8, "n_kv_heads": 8, "d_ff": 4096,
             "seq_len": 256, "vocab_size": 1024, "moe": {"experts": 64, "top_k": 2}}
    return _job(model, parallel={"device": "cuda"}, train={"global_batch_size": 64}, precision={"dtype": "bf16"})


def test_the_search_picks_an_ep_that_fits_where_ep_1_does_not():
    """On 2 nodes of 8 GPUs of 10 GB (9 GB with headroom) no layout fits at ep=1, and the picker runs the fastest
    that does, with its ep > 1 set in the job and the estimate's peak within the limit."""
    spec = _big_moe()
    shape, g = ls.Shape.of(spec), tm.gpu("H100").with_overrides(memory=10 * 10**9)
    result = ls.search(shape, 16, g, cps=[1], even_splits=True)
    assert result.best and all(c.layout.ep > 1 for c in result.best)
    unlimited = ls.search(shape, 16, g.with_overrides(memory=10**15), cps=[1], even_splits=True).best
    assert min(c.peak for c in unlimited if c.layout.ep == 1) > result.limit  # every ep=1 layout was priced
    choice = pick_layout(spec, 2, 8, gpu_mem=10 * 10**9, gpu_type="H100")
    assert choice.spec.parallel.ep == result.best[0].layout.ep > 1
    assert choice.peak.total_bytes <= result.limit


def test_dense_models_search_no_ep():
    spec = _job({"arch": "llama", "d_model": 64, "n_layers": 4, "n_heads": 4, "d_ff": 96, "seq_len": 32},
                parallel={"device": "cuda"}, train={"global_batch_size": 16})
    result = ls.search(ls.Shape.of(spec), 8, tm.gpu("H100"), cps=[1])
    assert {c.layout.ep for c in result.best} == {1}


def _nodes_of_expert_groups(dp: int, pp: int, cp: int, tp: int, ep: int, gpus_per_node: int) -> list[set[int]]:
    """The nodes each expert group's ranks land on under the placement's fill order (blocks of tp x cp ranks;
    group: one stage, one tp index, ep consecutive (dp, cp) indices)."""
    block = tp * cp
    node_of_block = {}
    order = fill_order(dp, pp, cp, ep)
    for b, node in zip(order, block_targets(len(order), [gpus_per_node // block] * (dp * pp * block)), strict=True):
        node_of_block[b] = node
    groups = []
    for s in range(pp):
        for first in range(0, dp * cp, ep):
            groups.append({node_of_block[(i // cp) * pp + s] for i in range(first, first + ep)})
    return groups


@pytest.mark.parametrize("tp, cp, ep", [(1, 1, 2), (1, 1, 8), (1, 1, 16), (2, 1, 4), (2, 1, 8), (1, 2, 4),
                                        (2, 2, 2), (4, 2, 4), (1, 4, 2), (8, 1, 2)])
def test_expert_link_is_nvlink_exactly_where_placement_packs_the_group_in_a_node(tp, cp, ep):
    """``time_model.expert_link`` prices the all-to-all on NVLink exactly where ``node_order.fill_order`` puts
    every rank of an expert group on one node (so the search prefers such groups where they fit)."""
    g, dp, pp = tm.gpu("H800"), 32 // cp, 2
    one_node = all(len(nodes) == 1 for nodes in _nodes_of_expert_groups(dp, pp, cp, tp, ep, g.gpus_per_node))
    assert one_node == (tp * math.lcm(ep, cp) <= g.gpus_per_node)
    assert tm.expert_link(g, tp, cp, ep) == (g.intra_bw if one_node else g.inter_bw)


def test_the_search_prefers_expert_groups_inside_a_node():
    """Where ep=8 (one node at tp=1) and ep=16 (two nodes) both fit, the faster is the one inside the node, and the
    same layout's all-to-all costs more across nodes by the link ratio."""
    spec = _big_moe()
    shape, g = ls.Shape.of(spec), tm.gpu("H800").with_overrides(memory=80 * 10**9)
    ev = ls.Evaluator(shape, g)
    inside, across = (ls.Layout(dp=16, tp=1, pp=1, zero=1, micro_batch=1, ep=e) for e in (8, 16))
    t_in, t_across = ev.step_time(inside)[0], ev.step_time(across)[0]
    assert t_in.exposed["ep"] < t_across.exposed["ep"]
    bytes_in, bytes_across = ev.step_time(inside)[1]["ep"], ev.step_time(across)[1]["ep"]
    assert t_across.exposed["ep"] / t_in.exposed["ep"] == pytest.approx(
        bytes_across / bytes_in * g.intra_bw / g.inter_bw)
    best = ls.search(shape, 16, g, cps=[1], even_splits=True).best
    expert_parallel = [c for c in best if c.layout.ep > 1]
    assert expert_parallel and expert_parallel[0].layout.tp * expert_parallel[0].layout.ep <= g.gpus_per_node


def test_a_micro_batch_of_any_divisor_is_priced():
    """A job's own micro-batch need not be a power of two (48 sequences over dp 2 and 8 microbatches: 3)."""
    spec = _job(MIXTRAL, parallel={"dp": 2, "ep": 2, "zero": 1, "device": "cuda"},
                train={"global_batch_size": 48, "microbatches": 8}, precision={"dtype": "bf16"})
    layout = ls.layout_of(spec)
    assert layout.micro_batch == 3
    peak = ls.Evaluator(ls.Shape.of(spec), tm.gpu("H100")).rank_peak(layout, 0)
    assert peak == est.peak_rank(spec).total_bytes


def test_trying_the_largest_ep_first_drops_no_layout_that_fits():
    """The search skips the middle ep degrees of a layout whose largest ep does not fit (``_with_experts``): the
    layouts it finds fitting are those every degree priced would have found."""
    shape, g = ls.Shape.of(_big_moe()), tm.gpu("H100").with_overrides(memory=10 * 10**9)
    result = ls.search(shape, 16, g, cps=[1], even_splits=True)
    ev = ls.Evaluator(shape, g)
    every = ls._priced(ev, ls.candidates(shape, 16, g, cps=[1], even_splits=True), None, result.limit)
    fitting = {lay for lay, peak, _ in every if peak <= result.limit}
    assert {c.layout for c in result.best} == fitting
    assert result.considered < sum(1 for _ in ls.candidates(shape, 16, g, cps=[1], even_splits=True))
