"""Hybrid sharding (``parallel.dp_shard``) in the spec, the grid and the planner: bad values are refused naming
the field, the mesh splits dp into replicate x shard, and memory and time per link class follow the shard size."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator import JobSpec
from orchestrator.errors import SpecError
from orchestrator.planning import comm_model as cm
from orchestrator.planning import estimate as est
from orchestrator.planning import layout_search as ls
from orchestrator.planning import time_model as tm
from orchestrator.planning.layout_picker import pick_layout
from workers.contract.grid import Grid

GPT = {"d_model": 64, "n_layers": 4, "n_heads": 4, "d_ff": 128, "seq_len": 32}


def _job(parallel: dict, **sections) -> JobSpec:
    return JobSpec.from_dict({"data": {"path": "/tmp/none"}, "run_dir": "/tmp/none", "model": GPT,
                              "parallel": {"device": "cuda", **parallel}, **sections})


@pytest.mark.parametrize("parallel, words", [
    ({"dp": 4, "dp_shard": 3, "zero": 3}, ["parallel.dp_shard", "3", "does not divide parallel.dp=4", "1, 2, 4"]),
    ({"dp": 4, "dp_shard": 2}, ["parallel.dp_shard", "zero 0 shards nothing", "zero: 1, 2 or 3"]),
    ({"dp": 4, "dp_shard": 2, "zero": 1, "dp_sync": "ps"}, ["parallel.dp_shard", "parameter-server"]),
    ({"dp": 4, "dp_shard": 2, "zero": 3, "ep": 2}, ["parallel.dp_shard", "expert parallelism"]),
    ({"dp": 2, "grad_reduce_dtype": "bf16"}, ["parallel.grad_reduce_dtype", "zero: 0", "grad_compression: bf16"]),
    ({"dp": 2, "zero": 3, "grad_reduce_dtype": "bf16", "_bf16_policy": True},
     ["parallel.grad_reduce_dtype", "precision.reduce_dtype: bf16"]),
    ({"dp": 2, "tp": 2, "zero": 3, "param_gather_dtype": "int8"},
     ["parallel.tp", "2", "param_gather_dtype: int8 at zero 3", "DTensors", "parallel.zero: 1"]),
    ({"dp": 2, "zero": 2, "param_gather_dtype": "bf16", "_compile": True},
     ["train.compile", "True", "param_gather_dtype: bf16 at zero 2", "remove train.compile"]),
    ({"dp": 2, "param_gather_dtype": "bf16"},
     ["parallel.param_gather_dtype", "bf16", "zero: 0", "parallel.zero: 1, 2 or 3"]),
    ({"dp": 2, "zero": 1, "dp_sync": "ps", "param_gather_dtype": "int8"},
     ["parallel.param_gather_dtype", "dp_sync: ps", "dp_sync: allreduce"]),
    ({"dp": 1, "zero": 1, "param_gather_dtype": "int8"}, ["parallel.param_gather_dtype", "parallel.dp: 2 or more"]),
])
def test_bad_dp_shard_is_refused_naming_the_field_and_the_fix(parallel, words):
    policy = {"precision": {"dtype": "bf16", "policy": "fsdp"}} if parallel.pop("_bf16_policy", False) else {}
    if parallel.pop("_compile", False):
        policy["train"] = {"compile": True}
    with pytest.raises(SpecError) as err:
        _job(parallel, **policy)
    for word in words:
        assert word in str(err.value)


def test_dp_shard_of_all_dp_is_plain_sharding():
    spec = _job({"dp": 4, "dp_shard": 4, "zero": 3})
    assert not spec.parallel.grid.hybrid and spec.parallel.grid.mesh_dims == ("dp", "pp", "tp")
    assert _job({"dp": 4, "zero": 0}).parallel.grid.shard_size == 4


def test_the_hybrid_mesh_splits_dp_into_replicas_of_the_nearest_shard_groups():
    grid = Grid(dp=4, pp=2, cp=2, tp=2, dp_shard=2)
    assert grid.mesh_dims == ("dp_replicate", "dp_shard", "pp", "cp", "tp")
    assert grid.mesh_shape == (2, 2, 2, 2, 2) and grid.replicas == 2
    # rank 0's shard group: dp 0 and 1 (the nearest) at its position, times its cp peers
    assert grid.shard_peers(0) == [0, 2, 8 * 1 + 0, 8 * 1 + 2]
    assert grid.shard_peers(grid.rank_of(dp=3, pp=1, tp=1)) == [grid.rank_of(dp=d, pp=1, cp=c, tp=1)
                                                                for d in (2, 3) for c in (0, 1)]
    # a replica is kept by the rank holding the same shard in the next replica (another shard group)
    assert grid.replica_peer(0) == grid.rank_of(dp=2) and grid.replica_peer(grid.rank_of(dp=3)) == grid.rank_of(dp=1)
    with pytest.raises(ValueError, match="dp_shard=3 does not divide dp=4"):
        Grid(dp=4, dp_shard=3)
    assert Grid(dp=4, dp_shard=2).with_dp(2).dp_shard == 2 and Grid(dp=4, dp_shard=4).with_dp(6).dp_shard is None


def test_model_state_follows_the_shard_size_not_dp():
    """ZeRO-3 over a shard group of 2 holds the state a plain dp=2 job holds, more than one sharded over all 8."""
    def state(parallel):
        return est.estimate_rank(_job(parallel, train={"global_batch_size": 16}), 0).state.persistent

    hybrid = state({"dp": 8, "dp_shard": 2, "zero": 3})
    assert hybrid == state({"dp": 2, "zero": 3}) > state({"dp": 8, "zero": 3})


def test_the_replicas_carry_only_the_reduction_of_a_shards_gradients():
    shape = cm.CommShape(param_bytes=800.0, grad_bytes=800.0, hidden_bytes=0.0, boundary_bytes=0.0)
    rows = cm.step_bytes(shape, dp=8, zero=3, microbatches=2, dp_shard=2)
    assert set(rows) >= {"dp_shard", "dp_replicate"} and "dp" not in rows
    assert rows["dp_shard"] == cm.data_parallel_bytes(800.0, 800.0, 2, 3, 2)  # ZeRO's own, inside the group
    assert rows["dp_replicate"] == cm.all_reduce(400.0, 4)  # half the gradients, over 4 replicas
    assert cm.step_bytes(shape, dp=8, zero=3, microbatches=2, dp_shard=8) == cm.step_bytes(shape, dp=8, zero=3,
                                                                                            microbatches=2)


def test_time_prices_shard_groups_on_nvlink_and_replicas_on_the_network():
    """dp=16 on 8-GPU nodes: plain ZeRO-3's gathers cross InfiniBand; in shard groups of 8 they stay on NVLink
    and only the replicas' all-reduce of 1/8 of the gradients crosses nodes, so the exposed dp time drops."""
    g = tm.gpu("H100")
    assert tm.data_parallel_links(g, 1, 16, 8) == {"dp_shard": g.intra_bw, "dp_replicate": g.inter_bw}
    assert tm.data_parallel_links(g, 1, 16, None) == {"dp": g.inter_bw}
    spec = _job({"dp": 16, "zero": 3}, train={"global_batch_size": 16})
    ev = ls.Evaluator(ls.Shape.of(spec), g)
    plain, hybrid = ls.layout_of(spec), ls.layout_of(_job({"dp": 16, "dp_shard": 8, "zero": 3},
                                                          train={"global_batch_size": 16}))
    assert hybrid.dp_shard == 8 and hybrid.shards == 8
    (t_plain, _), (t_hybrid, by_dim) = ev.step_time(plain), ev.step_time(hybrid)
    assert by_dim["dp_replicate"] > 0 and t_hybrid.exposed["dp"] < t_plain.exposed["dp"]


def test_a_bf16_reduction_is_priced_at_two_bytes_a_gradient():
    fp32, bf16 = (ls.Shape.of(_job({"dp": 4, "zero": 1, "grad_reduce_dtype": d})) for d in ("fp32", "bf16"))
    lay = ls.Layout(4, 1, 1, zero=1)
    a, b = ls.comm_shape(fp32, lay, 0), ls.comm_shape(bf16, lay, 0)
    assert b.grad_bytes * 2 == a.grad_bytes and b.param_bytes == a.param_bytes  # the slices gather in fp32


@pytest.mark.parametrize("dtype, per_value", [("bf16", 2), ("int8", 1 + 4 / 256)])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_a_quantized_gather_is_priced_at_its_wire_bytes(dtype, per_value, zero):
    fp32, low = (ls.Shape.of(_job({"dp": 4, "zero": zero, "param_gather_dtype": d})) for d in ("fp32", dtype))
    lay = ls.Layout(4, 1, 1, zero=zero)
    a, b = ls.comm_shape(fp32, lay, 0), ls.comm_shape(low, lay, 0)
    assert b.param_bytes == pytest.approx(a.param_bytes * per_value / 4) and b.grad_bytes == a.grad_bytes


def test_a_bf16_gather_under_fsdp2s_bf16_policy_moves_what_the_policy_moves():
    """The policy already gathers bf16: asking for bf16 gathers changes nothing; int8 still halves that again."""
    policy = {"precision": {"dtype": "bf16", "policy": "fsdp"}}
    plain, bf16, int8 = (ls.Shape.of(_job({"dp": 4, "zero": 3, "param_gather_dtype": d}, **policy))
                         for d in ("fp32", "bf16", "int8"))
    lay = ls.Layout(4, 1, 1, zero=3)
    assert ls.comm_shape(bf16, lay, 0).param_bytes == ls.comm_shape(plain, lay, 0).param_bytes
    assert ls.comm_shape(int8, lay, 0).param_bytes == pytest.approx(ls.comm_shape(plain, lay, 0).param_bytes
                                                                    * (1 + 4 / 256) / 2)


LLAMA_8B = ls.Shape(n_layers=32, d_model=4096, n_heads=32, ffn_dim=14336, vocab=128256, seq=2048, global_batch=64,
                    kv_heads=8)


def _model_time(shape: ls.Shape, lay: ls.Layout, g: tm.GPU) -> tm.StepTime:
    """A layout's step time rebuilt from the model's parts (bytes per mesh dim, links, prefetched gathers), apart
    from ``Evaluator.step_time``: one pipeline rank, tp=cp=pp=1."""
    assert (lay.tp, lay.pp, lay.cp) == (1, 1, 1)
    m, c = lay.microbatches(shape), ls.comm_shape(shape, lay, 0)
    rows = cm.step_bytes(c, lay.dp, zero=lay.zero, microbatches=m, dp_shard=lay.dp_shard)
    # ZeRO-2/3's parameter gathers are prefetched under the compute; ZeRO-1's gather follows the step
    gathers = rows.get("dp_shard", rows.get("dp")) - cm.reduce_scatter(c.grad_bytes, lay.shards) if lay.zero >= 2 else 0
    flops = tm.flops_per_token(shape.n_layers * shape.block_params + shape.vocab * shape.d_model, shape.n_layers,
                               shape.d_model, shape.seq, lay.recompute) * shape.global_batch * shape.seq / lay.dp
    return tm.step_time(flops, rows, g, {"dp": lay.dp, "dp_shard": lay.dp_shard}, m, gather_bytes=gathers)


def test_the_search_shards_inside_a_node_when_the_cross_node_gathers_dominate():
    """Llama 3 8B, 64 sequences of 2K on 4 nodes x 8 H100: dp=32 ZeRO-3 over all of dp gathers its parameters over
    InfiniBand, far longer than the step's compute; the search, trying dp_shard values whose shard group fits a
    node, picks shard groups of 8 (NVLink) whose replicas all-reduce 1/8 of the gradients across nodes. The
    figures are the model's, rebuilt here from its parts."""
    g = tm.gpu("H100")
    result = ls.search(LLAMA_8B, 32, g, cps=[1])
    best = result.best[0]
    assert best.layout.dp_shard is not None and best.layout.dp_shard < best.layout.dp
    assert best.layout.dp_shard * best.layout.tp * best.layout.pp <= g.gpus_per_node  # one shard group per node
    hybrid = _model_time(LLAMA_8B, best.layout, g)
    assert best.step_s == pytest.approx(hybrid.total, rel=1e-12)
    plain_layout = ls.Layout(best.layout.dp, 1, 1, 1, best.layout.zero, best.layout.micro_batch)
    plain = _model_time(LLAMA_8B, plain_layout, g)
    shape = ls.comm_shape(LLAMA_8B, plain_layout, 0)
    cross_node_gathers = (cm.step_bytes(shape, plain_layout.dp, zero=plain_layout.zero,
                                        microbatches=plain_layout.microbatches(LLAMA_8B))["dp"]
                          - cm.reduce_scatter(shape.grad_bytes, plain_layout.dp)) / g.inter_bw
    assert cross_node_gathers > plain.compute  # the gathers outlast the compute that hides them
    assert plain.exposed["dp"] >= cross_node_gathers - plain.compute > hybrid.exposed["dp"]
    priced = {c.layout: c.step_s for c in result.best + result.too_big}
    assert priced.get(plain_layout, plain.total) == pytest.approx(plain.total)
    assert plain.total > best.step_s


def test_the_search_keeps_plain_sharding_on_one_node():
    """The same model on one node of 8 H200 (16 sequences): every link is NVLink, so a shard group only adds
    state and the replicas' all-reduce; the search tries the hybrid layouts (they fit) and keeps plain sharding."""
    g, shape = tm.gpu("H200"), replace(LLAMA_8B, global_batch=16)
    result = ls.search(shape, 8, g, cps=[1])
    best = result.best[0]
    assert best.layout.zero >= 1 and best.layout.dp > 1 and best.layout.dp_shard is None
    plain = {c.layout: c for c in result.best if c.layout.dp_shard is None}
    hybrid = [c for c in result.best if c.layout.dp_shard]
    assert hybrid, "no hybrid layout fits: the test needs one to mean something"
    for c in hybrid:  # each priced by the model, no faster than its plain twin and holding more
        twin = plain[replace(c.layout, dp_shard=None)]
        if c.layout.tp == c.layout.pp == 1:
            assert c.step_s == pytest.approx(_model_time(shape, c.layout, g).total, rel=1e-12)
        assert c.step_s >= twin.step_s and c.peak > twin.peak


def test_the_search_tries_only_shard_groups_inside_a_node():
    assert ls.hybrid_shard_sizes(32, 1, 8) == [8, 4, 2]
    assert ls.hybrid_shard_sizes(32, 2, 8) == [4, 2]  # tp=2: four dp ranks fill a node
    assert ls.hybrid_shard_sizes(8, 8, 8) == [] and ls.hybrid_shard_sizes(4, 1, 8) == [2]  # 4: plain, in a node
    shape = replace(LLAMA_8B, global_batch=32)
    shards = {(lay.zero, lay.dp_shard) for lay in ls.candidates(shape, 32, tm.gpu("H100"), cps=[1])
              if lay.tp == 1 and lay.pp == 1}
    assert shards == {(0, None)} | {(z, d) for z in (1, 2, 3) for d in (None, 8, 4, 2)}


def test_the_picked_plan_carries_dp_shard_into_the_job():
    """``raymesh plan --nodes 4``: the picked job sets the winner's dp_shard (and clears a job's own elsewhere)."""
    spec = JobSpec.from_dict({"data": {"path": "/tmp/none"}, "run_dir": "/tmp/none",
                              "model": {"preset": "llama3-8b", "seq_len": 2048}, "precision": {"dtype": "bf16"},
                              "parallel": {"device": "cuda"}, "train": {"global_batch_size": 64}})
    choice = pick_layout(spec, nodes=4, gpus_per_node=8, gpu_type="H100")
    lay = choice.candidate.layout
    assert lay.dp_shard is not None and choice.spec.parallel.dp_shard == lay.dp_shard
    assert choice.spec.parallel.grid.mesh_dims[:2] == ("dp_replicate", "dp_shard")
    own = spec.with_overrides(["parallel.dp=4", "parallel.zero=3", "parallel.dp_shard=2"])
    assert pick_layout(own, nodes=1, gpus_per_node=8, gpu_type="H200").spec.parallel.dp_shard is None
