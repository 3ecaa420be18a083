"""``parameter_server.compression`` without Ray: in-process shards and clients (as in test_ps_checkpoint.py).

Top-k's error feedback delivers the whole gradient sum over steps; bf16 halves the bytes of pushes and pulls and
top-k sends k values plus positions; sparse messages survive the gRPC encoding and bad ones are refused; a BSP
training run with bf16 on the wire stays near the uncompressed run; an fp16 overflow skips a clock.
"""

from __future__ import annotations

import pytest
import torch

from parameter_server.client import PSClient
from parameter_server.proto import ps_pb2
from parameter_server.shard import PSShard
from parameter_server.wire import from_msg, to_msg
from tests.support.ps_local import LocalConn
from workers.parallel.grad_compression import WireCodec

SGD = {"name": "sgd", "lr": 1.0, "weight_decay": 0.0, "betas": [0.9, 0.95], "momentum": 0.0}
ADAMW = {"name": "adamw", "lr": 3e-2, "weight_decay": 0.1, "betas": [0.9, 0.95], "momentum": 0.0}


def cluster(workers: int, codec: dict, optim: dict, params: dict, steps: int = 50, chunk_elems: int = 64):
    shards = [PSShard(i, "bsp", optim, workers, [optim["lr"]] * steps) for i in range(2)]
    clients = [PSClient([LocalConn(s) for s in shards], chunk_elems, 16, worker=w, codec=WireCodec(**codec))
               for w in range(workers)]
    for c in clients:
        c.register(params)
    return shards, clients


def test_topk_error_feedback_delivers_the_dense_sum():
    """With SGD at lr 1 the shard's parameter moves by exactly what it received; that plus what the worker still
    holds back (its errors) is the sum of every gradient it was given."""
    start = {"w": torch.zeros(10, 13), "b": torch.zeros(5)}
    _, (client,) = cluster(1, {"kind": "topk", "topk_ratio": 0.1}, SGD, start)
    gen = torch.Generator().manual_seed(0)
    total = {n: torch.zeros_like(p) for n, p in start.items()}
    for clock in range(8):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in start.items()}
        client.push(clock, grads)
        client.apply(clock, 1.0)
        for n in grads:
            total[n] += grads[n]
    got = client.pull(list(start), min_version=8)
    for n in start:
        held_back = torch.cat([client.codec.errors[k] for k in client.keys_of(n)]).reshape(start[n].shape)
        assert held_back.abs().sum() > 0  # something was left out each step ...
        torch.testing.assert_close(-got[n] + held_back, total[n], rtol=0, atol=1e-5)  # ... and nothing lost


def _step_bytes(kind: str, ratio: float = 0.01) -> int:
    params = {"w": torch.randn(100, 64), "b": torch.randn(64)}  # 6464 elements in chunks of 64: 101 chunks
    _, (client,) = cluster(1, {"kind": kind, "topk_ratio": ratio}, SGD, params)
    client.push(0, {n: torch.randn(p.shape) for n, p in params.items()})
    client.apply(0, 1.0)
    push = client.take_wire_bytes()
    client.pull(list(params), min_version=1)
    return push, client.take_wire_bytes()


def test_bytes_on_the_wire():
    """Each chunk goes to its two holders; a pull reads each chunk once."""
    push, pull = _step_bytes("none")
    assert (push, pull) == (2 * 6464 * 4, 6464 * 4)
    assert _step_bytes("bf16") == (push // 2, pull // 2)
    push_topk, pull_topk = _step_bytes("topk", 0.1)  # 6 of each 64-entry chunk, each value + an int32 position
    assert (push_topk, pull_topk) == (2 * 101 * 6 * 8, pull)


def test_sparse_message_round_trip_and_refusals():
    grad = torch.sparse_coo_tensor(torch.tensor([[1, 4]]), torch.tensor([2.5, -1.0]), (6,), check_invariants=True)
    back = from_msg(to_msg("w#0", grad))
    assert back.is_sparse and torch.equal(back.to_dense(), grad.to_dense())
    bad = to_msg("w#0", grad)
    bad.indices = torch.tensor([1, 6], dtype=torch.int32).numpy().tobytes()
    with pytest.raises(ValueError, match="'w#0': a position outside shape"):
        from_msg(bad)
    with pytest.raises(ValueError, match="value bytes for 3 positions"):
        from_msg(ps_pb2.Tensor(key="w#0", dtype="float32", shape=[6], data=bad.data,
                               indices=torch.tensor([0, 1, 2], dtype=torch.int32).numpy().tobytes()))
    shard = PSShard(0, "bsp", SGD, 1, [1.0])
    shard.register({"w#0": torch.zeros(6)})
    for size, position in ((7, 0), (6, 9)):  # a shape not the chunk's; a position past it (unchecked over Ray)
        sparse = torch.sparse_coo_tensor(torch.tensor([[position]]), torch.tensor([1.0]), (size,),
                                          check_invariants=False)
        with pytest.raises(ValueError, match=rf"sparse shape \({size},\) \(positions {position} to {position}\), "
                                             r"expected a 1-D chunk of shape \(6,\); nothing applied"):
            shard.push(0, 0, {"w#0": sparse})
    assert shard.staged == {}
    with pytest.raises(ValueError, match="wire_dtype 'float16'"):
        shard.pull(["w#0"], wire_dtype="float16")


def _train(kind: str, steps: int = 12) -> list[float]:
    """Two BSP workers fit y = X w* with AdamW on the shards; each worker's loss on its own half per step."""
    gen = torch.Generator().manual_seed(1)
    x, w_true = torch.randn(2, 32, 16, generator=gen), torch.randn(16, 4, generator=gen)
    _, clients = cluster(2, {"kind": kind}, ADAMW, {"w": torch.zeros(16, 4)}, steps)
    losses = []
    for clock in range(steps):
        step_loss = 0.0
        for worker, client in enumerate(clients):
            w = client.pull(["w"], min_version=clock)["w"].requires_grad_()
            loss = (x[worker] @ w - x[worker] @ w_true).pow(2).mean()
            loss.backward()
            client.push(clock, {"w": w.grad})
            step_loss += loss.item() / len(clients)
        clients[0].apply(clock, 1.0)
        losses.append(step_loss)
    return losses


def test_bsp_with_bf16_on_the_wire_stays_near_the_uncompressed_run():
    """Stated tolerance: each step's loss within 2% of the uncompressed run's (bf16 keeps 8 bits of mantissa,
    relative rounding 2^-9 per value; the shards still step in fp32)."""
    exact, bf16 = _train("none"), _train("bf16")
    assert exact[-1] < 0.8 * exact[0]  # it trains
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(exact), rtol=2e-2, atol=0)
    assert bf16 != exact  # and the wire really was lossy


def test_skip_passes_a_clock_without_a_step_and_never_drops_a_push():
    shard = PSShard(0, "bsp", ADAMW, 2, [0.1, 0.2, 0.3])
    shard.register({"w#0": torch.ones(3)})
    assert shard.apply(0, 0.0) == 1 and shard.apply(0, 0.0) == 1  # idempotent: the second worker's call
    assert torch.equal(shard.pull(["w#0"])["chunks"]["w#0"], torch.ones(3))
    assert shard.opts["w#0"].state == {}  # no optimizer step ran (AdamW would decay and count it)
    shard.push(0, 1, {"w#0": torch.ones(3)})
    with pytest.raises(ValueError, match=r"of clock 1, for which workers \[0\] pushed; nothing skipped"):
        shard.apply(1, 0.0)
    shard.push(1, 1, {"w#0": torch.ones(3)})
    shard.apply(1, 1.0)
    assert shard.opts["w#0"].param_groups[0]["lr"] == 0.2  # the step after a skip runs at its own step's rate


def _spec(parallel: dict | None = None, **sections):
    from orchestrator import JobSpec

    return JobSpec.from_dict({"data": {"path": "d"}, "parallel": {"dp": 2, "dp_sync": "ps", **(parallel or {})},
                              **sections})


@pytest.mark.parametrize(("sections", "field", "value", "fix"), [
    ({"parameter_server": {"compression": "bf16", "topk_ratio": 0.05}}, "parameter_server.topk_ratio", 0.05,
     "compression: topk"),
    ({"parallel": {"grad_compression": "bf16"}}, "parallel.grad_compression", "bf16", "parameter_server.compression"),
    ({"parallel": {"tp": 2}, "parameter_server": {"consistency": "ssp"}}, "parameter_server.consistency", "ssp",
     "consistency: bsp"),
])
def test_spec_refusals_name_field_value_and_fix(sections, field, value, fix):
    from orchestrator.errors import SpecError

    parallel = sections.pop("parallel", None)
    with pytest.raises(SpecError) as info:
        _spec(parallel, **sections)
    assert (info.value.field, info.value.value) == (field, value) and fix in info.value.fix


def test_spec_accepts_compression_and_fp16_under_bsp():
    job = _spec(precision={"dtype": "fp16"}, parameter_server={"compression": "topk", "topk_ratio": 0.05})
    assert job.worker_dict()["parameter_server"]["topk_ratio"] == 0.05


def test_spec_accepts_asp_and_ssp_with_pipelines_and_fp16():
    """Once refused: each stage's keys run on their own clocks, and an fp16 overflow is one replica's to skip."""
    for consistency in ("asp", "ssp"):
        job = _spec({"pp": 2}, precision={"dtype": "fp16"}, train={"microbatches": 2},
                    parameter_server={"consistency": consistency})
        assert job.worker_dict()["parallel"]["pp"] == 2


@pytest.mark.parametrize("kind", ["bf16", "topk"])
def test_grpc_carries_the_same_compressed_messages(kind):
    """The same steps over the shards' real gRPC service (sparse pushes, bf16 pulls) give what in-process calls
    give, byte for byte."""
    from parameter_server.grpc_service import GrpcConn, serve

    params = {"w": torch.randn(12, 9, generator=torch.Generator().manual_seed(2))}
    grads = [{"w": torch.randn(12, 9, generator=torch.Generator().manual_seed(3 + s))} for s in range(3)]
    shards, (local,) = cluster(1, {"kind": kind, "topk_ratio": 0.2}, ADAMW, params)
    remote_shards = [PSShard(i, "bsp", ADAMW, 1, [ADAMW["lr"]] * 50) for i in range(2)]
    endpoints = [serve(s, "127.0.0.1", "t") for s in remote_shards]
    try:
        remote = PSClient([GrpcConn(e.address, "t") for e in endpoints], 64, 16, worker=0,
                          codec=WireCodec(kind, 0.2))
        remote.register(params)
        for clock, g in enumerate(grads):
            for client in (local, remote):
                client.push(clock, g)
                client.apply(clock, 1.0)
            want, got = local.pull(["w"], clock + 1)["w"], remote.pull(["w"], clock + 1)["w"]
            assert torch.equal(want, got) and local.take_wire_bytes() == remote.take_wire_bytes()
        assert torch.equal(remote_shards[0].params["w#0"], shards[0].params["w#0"])  # fp32 state, not bf16
    finally:
        for e in endpoints:
            e.server.stop(0)


def _feedback_keys(chunk_elems: int):
    """A PSSync with only what its checkpoint keys read: one parameter, its chunk size, dp 2, worker 0."""
    from types import SimpleNamespace

    from workers.parallel.ps_sync import PSSync

    sync = object.__new__(PSSync)
    sync.named = {"stage0.w": torch.nn.Parameter(torch.zeros(4, 6))}
    sync.client = SimpleNamespace(chunk_elems=chunk_elems)
    sync.dp, sync.device = 2, "cpu"
    sync.worker, sync.codec = 0, SimpleNamespace(errors={})
    return sync


def test_topk_feedback_resumed_at_another_chunk_size_starts_at_zero(tmp_path):
    """Chunks of 10 and of 16 share names (``stage0.w#0``) but not sizes: a resume at another
    ``parameter_server.chunk_elems`` finds no feedback of its own and starts from zero, as at another dp, instead
    of DCP refusing the load over the sizes."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    saved = _feedback_keys(10)
    saved.codec.errors = {k.split("/", 1)[1]: torch.randn(v.shape) for k, v in saved.dcp_state(template=True).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialised
        dcp.save({"wire_feedback": saved.dcp_state()}, checkpoint_id=str(tmp_path), no_dist=True)
        for chunk_elems, taken in ((16, False), (10, True)):
            sync = _feedback_keys(chunk_elems)
            feedback = {"wire_feedback": sync.dcp_state(template=True)}
            dcp.load(feedback, checkpoint_id=str(tmp_path), planner=DefaultLoadPlanner(allow_partial_load=True),
                     no_dist=True)
            assert sync.load_dcp_state(feedback["wire_feedback"]) is taken, chunk_elems
    assert all(torch.equal(sync.codec.errors[k], e) for k, e in saved.codec.errors.items())
