"""Hybrid sharding (``parallel.dp_shard``) in the spec, the grid and the planner: bad values are refused naming
the field, the mesh splits dp into replicate x shard, and memory and time per link class follow the shard size."""

from __future__ import annotations

import pytest

from orchestrator import JobSpec
from orchestrator.errors import SpecError
from orchestrator.planning import comm_model as cm
from orchestrator.planning import estimate as est
from orchestrator.planning import layout_search as ls
from orchestrator.planning import time_model as tm
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
    ({"dp": 2, "zero": 3, "param_gather_dtype": "int8"},
     ["parallel.param_gather_dtype", "int8", "computes in the dtype it gathers", "zero: 3", "parallel.zero: 1"]),
    ({"dp": 2, "param_gather_dtype": "bf16"}, ["parallel.param_gather_dtype", "bf16", "zero: 0", "parallel.zero: 1"]),
    ({"dp": 2, "zero": 1, "dp_sync": "ps", "param_gather_dtype": "int8"},
     ["parallel.param_gather_dtype", "dp_sync: ps", "dp_sync: allreduce"]),
    ({"dp": 1, "zero": 1, "param_gather_dtype": "int8"}, ["parallel.param_gather_dtype", "parallel.dp: 2 or more"]),
])
def test_bad_dp_shard_is_refused_naming_the_field_and_the_fix(parallel, words):
    policy = {"precision": {"dtype": "bf16", "policy": "fsdp"}} if parallel.pop("_bf16_policy", False) else {}
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
def test_a_quantized_gather_is_priced_at_its_wire_bytes_and_only_at_zero_1(dtype, per_value):
    fp32, low = (ls.Shape.of(_job({"dp": 4, "zero": 1, "param_gather_dtype": d})) for d in ("fp32", dtype))
    lay = ls.Layout(4, 1, 1, zero=1)
    a, b = ls.comm_shape(fp32, lay, 0), ls.comm_shape(low, lay, 0)
    assert b.param_bytes == pytest.approx(a.param_bytes * per_value / 4) and b.grad_bytes == a.grad_bytes
    zero3 = ls.Layout(4, 1, 1, zero=3)  # a layout the planner considers for the same job: FSDP2 gathers fp32
    assert ls.comm_shape(low, zero3, 0).param_bytes == ls.comm_shape(fp32, zero3, 0).param_bytes
