"""Over the wire, as an outsider would: raw gRPC calls to a live job's control API and to its parameter-server shards.

Each job is held at a step while the calls land; malformed, unauthenticated and out-of-range requests must be
refused and change nothing: the job stays at the same step and data-parallel degree and ends without a recovery or
resize, and the shards' parameters and versions are the same before and after.
"""

from __future__ import annotations

import json
import random
import socket

import grpc
import pytest
import ray
import torch
from ray.util.state import list_actors

from orchestrator import TrainingJob
from orchestrator.api.auth import job_token
from orchestrator.api.proto import control_pb2, control_pb2_grpc
from parameter_server.auth import call_metadata, client_token
from parameter_server.errors import CertificateRefused
from parameter_server.proto import ps_pb2, ps_pb2_grpc
from parameter_server.reader import connect
from parameter_server.ring import split
from parameter_server.wire import to_msg
from tests.support.jobs import tiny_spec, wait_for
from tests.support.live_job import start_live
from tests.support.tls import pem_files

STEPS = 6
HOLD_AT = 3


def non_loopback_ip() -> str:
    """This machine's address on its default route (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))
        return s.getsockname()[0]


def code_of(call, request, metadata=()) -> grpc.StatusCode:
    try:
        call(request, timeout=10, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def bad_control_requests(rng: random.Random, n: int) -> list[tuple[str, object]]:
    """Requests no 2-rank allreduce job can take: fault kinds it cannot recover or does not know, non-finite or
    too small factors, ranks out of range, data-parallel degrees it cannot split its batch over, long reasons."""
    fixed = [
        ("InjectFault", control_pb2.FaultRequest(kind="kill_ps_shard", rank=0)),  # no shards: crashed the controller
        ("InjectFault", control_pb2.FaultRequest(kind="slow_rank", rank=0, factor=float("inf"))),
        ("InjectFault", control_pb2.FaultRequest(kind="slow_rank", rank=0, factor=float("nan"))),
        ("InjectFault", control_pb2.FaultRequest(kind="kill_rank", rank=2)),
        ("RequestScale", control_pb2.ScaleRequest(dp=0)),
        ("RequestScale", control_pb2.ScaleRequest(dp=3)),
        ("Stop", control_pb2.StopRequest(reason="x" * 10_000)),
    ]
    kinds = ["kill_rank", "kill_node", "hang_rank", "slow_rank", "nan_loss", "kill_ps_shard", "", "rm -rf", "\n"]
    fuzzed = []
    for _ in range(n):
        if rng.random() < 0.6:
            kind = rng.choice(kinds)
            rank = rng.choice([-(2**31), -1, 2, 7, 2**31 - 1]) if kind not in ("kill_ps_shard", "", "rm -rf", "\n") \
                else rng.choice([0, 1, -1, 99])
            factor = rng.choice([float("inf"), float("-inf"), float("nan"), -3.0, 0.5, 1.0, 1e308 * 10])
            fuzzed.append(("InjectFault", control_pb2.FaultRequest(kind=kind, rank=rank, factor=factor)))
        else:
            fuzzed.append(("RequestScale", control_pb2.ScaleRequest(dp=rng.choice([-(2**31), -1, 0, 3, 5, 7]))))
    return fixed + fuzzed


def test_control_api_over_the_wire(ray_cluster, token_data, tmp_path):
    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 2}, train={"steps": STEPS}, control={"allow_faults": True})
    client, finish = start_live(spec, hold_at=HOLD_AT)
    try:
        host, port = client.address.rsplit(":", 1)
        assert host == "127.0.0.1"
        with pytest.raises(ConnectionRefusedError):  # not reachable on the machine's own network address
            socket.create_connection((non_loopback_ip(), int(port)), timeout=5).close()

        stub = control_pb2_grpc.ControlStub(grpc.insecure_channel(client.address))
        for method, request in [("Status", control_pb2.StatusRequest()), ("Stop", control_pb2.StopRequest()),
                                ("InjectFault", control_pb2.FaultRequest(kind="kill_rank", rank=1)),
                                ("RequestScale", control_pb2.ScaleRequest(dp=1))]:
            for metadata in ((), call_metadata("guess"), call_metadata("")):
                assert code_of(getattr(stub, method), request, metadata) == grpc.StatusCode.UNAUTHENTICATED, method
        token = call_metadata(job_token(spec.resolved_run_dir()).value)
        for method, request in bad_control_requests(random.Random(5), 150):
            assert code_of(getattr(stub, method), request, token) == grpc.StatusCode.INVALID_ARGUMENT, request
        status = stub.Status(control_pb2.StatusRequest(), timeout=10, metadata=token)  # with the token it works
        assert status.step == HOLD_AT and status.state == "running" and json.loads(status.layout)["dp"] == 2
    finally:
        result = finish()
    assert result.status == "finished" and result.steps == STEPS
    assert result.recoveries == [] and result.layout["dp"] == 2 and result.layout["world_size"] == 2


def shard_state(routes) -> tuple[dict, list[int]]:
    """Every parameter and every shard's version, read with the job's token."""
    reader = connect(routes)
    return reader.pull(sorted(reader.layout)), [c["version"] for c in reader.clocks()]


def bad_ps_requests(chunks: dict[str, torch.Tensor], version: int) -> list[tuple[str, object]]:
    """Requests a shard holding ``chunks`` (key: value) at ``version`` must refuse; none is a worker's."""
    some = next(iter(chunks))
    nan = to_msg(some, torch.full_like(chunks[some], float("nan")))  # the right key, shape and dtype: only nan
    return [
        ("Push", ps_pb2.PushRequest(worker=2, clock=version, grads=[])),  # a phantom third worker
        ("Push", ps_pb2.PushRequest(worker=-1, clock=version, grads=[])),
        ("Push", ps_pb2.PushRequest(worker=0, clock=version + 5, grads=[])),  # a clock in the future
        ("Push", ps_pb2.PushRequest(worker=0, clock=version, grads=[nan])),
        ("Push", ps_pb2.PushRequest(worker=0, clock=version, grads=[to_msg("nope#0", torch.ones(3))])),
        ("Register", ps_pb2.RegisterRequest(chunks=[to_msg("extra#0", torch.ones(4))])),  # would stall BSP
        ("Apply", ps_pb2.ApplyRequest(clock=version + 1, coef=1.0)),
        ("Apply", ps_pb2.ApplyRequest(clock=version - 1, coef=50000.0)),
        ("GradSq", ps_pb2.GradSqRequest(clock=version + 3, keys=[some])),
        ("Pull", ps_pb2.PullRequest(keys=[some], min_version=version + 50, worker=-1, clock=-1)),
        ("Pull", ps_pb2.PullRequest(keys=[some], worker=9, clock=0)),
    ]


def test_parameter_server_shards_over_the_wire(ray_cluster, token_data, tmp_path):
    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 2, "dp_sync": "ps"}, train={"steps": STEPS},
                     parameter_server={"shards": 2, "transport": "grpc", "chunk_elems": 1024},
                     checkpoint={"memory_every": 0})
    _, finish = start_live(spec, hold_at=HOLD_AT)
    try:
        routes_file = spec.resolved_run_dir() / "ps_routes.json"
        routes = json.loads(routes_file.read_text())
        assert {a.rsplit(":", 1)[0] for a in routes["addresses"]} == {ray.util.get_node_ip_address()}
        before, versions = shard_state(routes_file)
        assert versions == [HOLD_AT, HOLD_AT]
        token = call_metadata(client_token(routes["token"]))
        chunks = {k: v for name, t in before.items() for k, v in split(name, t, routes["chunk_elems"]).items()}
        for address in routes["addresses"]:
            stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(address))
            anyone = [("Pull", ps_pb2.PullRequest(keys=list(chunks)[:1], worker=-1, clock=-1)),
                      ("Clock", ps_pb2.ClockRequest()), *bad_ps_requests(chunks, HOLD_AT)]
            for method, request in anyone:
                assert code_of(getattr(stub, method), request) == grpc.StatusCode.UNAUTHENTICATED, method
            held = {k: v for k, v in chunks.items()
                    if code_of(stub.Pull, ps_pb2.PullRequest(keys=[k], worker=-1, clock=-1), token)
                    == grpc.StatusCode.OK}
            assert held  # with the token the same call works
            for method, request in bad_ps_requests(held, HOLD_AT):
                assert code_of(getattr(stub, method), request, token) == grpc.StatusCode.INVALID_ARGUMENT, request
        after, versions_after = shard_state(routes_file)
        assert versions_after == versions
        assert all(torch.equal(before[name], after[name]) for name in before)
    finally:
        result = finish()
    assert result.status == "finished" and result.steps == STEPS and result.recoveries == []


def test_parameter_server_shards_speak_tls_only_with_a_certificate(ray_cluster, token_data, tmp_path):
    """The ranks push and pull over TLS (the job finishes with transport grpc), the outside reader dials TLS from
    ps_routes.json, and a plaintext caller with the token gets no answer."""
    cert, key = pem_files(tmp_path / "pki", ray.util.get_node_ip_address())  # the address the shards announce
    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 2, "dp_sync": "ps"}, train={"steps": 4},
                     parameter_server={"shards": 2, "transport": "grpc", "chunk_elems": 1024,
                                       "tls_cert": str(cert), "tls_key": str(key)},
                     checkpoint={"memory_every": 0})
    _, finish = start_live(spec, hold_at=2)
    try:
        routes_file = spec.resolved_run_dir() / "ps_routes.json"
        routes = json.loads(routes_file.read_text())
        assert routes["tls_cert"] == str(cert)
        assert shard_state(routes_file)[1] == [2, 2]  # the reader, over TLS
        token = call_metadata(client_token(routes["token"]))
        for address in routes["addresses"]:
            stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(address))
            assert code_of(stub.Clock, ps_pb2.ClockRequest(), token) == grpc.StatusCode.UNAVAILABLE
    finally:
        result = finish()
    assert result.status == "finished" and result.steps == 4 and result.recoveries == []


def test_a_certificate_that_does_not_name_the_shards_node_fails_the_job_at_start(ray_cluster, token_data, tmp_path):
    """A certificate made for another address: the controller dials each shard as a rank would and the job ends
    before its first step, naming the field, the address and the fix (not with every rank finding every shard
    down); the shards it started are stopped."""
    cert, key = pem_files(tmp_path / "pki", "10.9.9.9")
    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 2, "dp_sync": "ps"}, train={"steps": 2},
                     parameter_server={"shards": 2, "transport": "grpc", "tls_cert": str(cert), "tls_key": str(key)})
    before = _live_shards()
    with pytest.raises(CertificateRefused, match=rf"fix: parameter_server.tls_cert must name "
                                                 rf"{ray.util.get_node_ip_address()} among"):
        TrainingJob(spec, progress=False).run()
    wait_for(lambda: _live_shards() == before, 30, "the job's shards to be stopped")


def _live_shards() -> int:
    return len(list_actors(filters=[("class_name", "=", "PSShard"), ("state", "=", "ALIVE")]))
