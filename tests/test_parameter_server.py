"""Parameter-server data parallelism: BSP equals all-reduce, bad pushes apply nothing, SSP keeps its bound,
a killed shard loses no acknowledged update, and a process outside Ray reads the same weights over gRPC."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import ray
import torch

from orchestrator import TrainingJob
from parameter_server.client import PSClient, RayConn
from parameter_server.ring import HashRing, split
from parameter_server.shard import PSShard
from tests.conftest import tiny_spec

STEPS = 6
ADAMW = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.95], "momentum": 0.0}


def _ps_run(token_data, tmp_path, parallel=None, **ps):
    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 4, "dp_sync": "ps", **(parallel or {})},
                     train={"steps": STEPS}, parameter_server={"shards": 3, "chunk_elems": 1024, **ps},
                     checkpoint={"memory_every": 0})
    return TrainingJob(spec, progress=False).run()


@pytest.fixture(scope="module")
def allreduce_dp4(ray_cluster, token_data, tmp_path_factory):
    spec = tiny_spec(token_data, tmp_path_factory.mktemp("ar"), parallel={"dp": 4}, train={"steps": STEPS})
    return TrainingJob(spec, progress=False).run()


def test_ring_spreads_chunks_and_names_a_distinct_successor():
    ring = HashRing(4, 64)
    keys = list(split("w", torch.zeros(64 * 1024), 1024))
    primaries = [ring.primary(k) for k in keys]
    assert all(primaries.count(s) >= 4 for s in range(4))  # 64 chunks over 4 shards: none starved
    assert all(len(set(ring.holders(k))) == 2 for k in keys)
    assert HashRing(1).holders("w#0") == [0]


def test_bsp_matches_allreduce(allreduce_dp4, token_data, tmp_path):
    result = _ps_run(token_data, tmp_path, consistency="bsp")
    assert result.losses == pytest.approx(allreduce_dp4.losses, rel=1e-5)
    assert result.grad_norms == pytest.approx(allreduce_dp4.grad_norms, rel=1e-5)


def test_bad_push_names_key_and_shapes_and_applies_nothing(ray_cluster):
    shards = [ray.remote(PSShard).options(max_concurrency=8, num_cpus=0).remote(i, "asp", ADAMW, 1) for i in range(2)]
    client = PSClient([RayConn(h) for h in shards], chunk_elems=8, vnodes=16, worker=0)
    params = {"w": torch.randn(4, 6), "b": torch.randn(6)}
    client.register(params)
    before = client.pull(["w", "b"])
    with pytest.raises(ValueError, match=r"'w'.*shape \(4, 5\).*expected shape \(4, 6\)"):
        client.push(0, {"b": torch.ones(6), "w": torch.ones(4, 5)}, 0.1)
    with pytest.raises(ValueError, match=r"'b'.*dtype float64"):
        client.push(0, {"b": torch.ones(6, dtype=torch.float64)}, 0.1)
    with pytest.raises(KeyError, match=r"'nope'"):
        client.push(0, {"nope": torch.ones(3)}, 0.1)
    with pytest.raises(KeyError, match=r"unknown key 'w#9'"):  # a shard checks too (an outside client)
        RayConn(shards[0]).push(0, 0, {"w#9": torch.ones(8)}, 0.1).result()
    after = client.pull(["w", "b"])
    assert all(torch.equal(before[n], after[n]) for n in params)
    assert [c["version"] for c in client.clocks()] == [0, 0]
    for h in shards:
        ray.kill(h)
