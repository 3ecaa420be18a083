"""A parameter-server shard over its real gRPC service, no Ray: a caller without the job's token gets nothing, and one
with it can steer no more than a worker may (the learning rate and the step are the shard's own; ids, clocks, keys,
shapes, finiteness checked before any state changes; waits end at the caller's deadline)."""

from __future__ import annotations

import os
import random
import stat
import threading
import time

import grpc
import pytest
import torch

from orchestrator.spec import load_spec
from parameter_server.auth import TOKEN_ENV, TOKEN_FILE, call_metadata
from parameter_server.errors import CertificateRefused, ShardDown
from parameter_server.grpc_service import GrpcConn, check_handshake, serve
from parameter_server.proto import ps_pb2, ps_pb2_grpc
from parameter_server.reader import ROUTES_FILE, pull_parameters, read_routes, write_routes
from parameter_server.shard import PSShard
from parameter_server.tls import TLS_CA_ENV, read_pair
from parameter_server.wire import to_msg
from tests.support.spec_errors import assert_actionable, spec_error
from tests.support.tls import self_signed

TOKEN = "shard-token"
SGD = {"name": "sgd", "lr": 0.5, "weight_decay": 0.0, "betas": [0.9, 0.95], "momentum": 0.0}
LRS = [0.5, 0.25, 0.125]  # the job's schedule: one learning rate per step
KEYS = ("w#0", "b#0")


def start(consistency: str, workers: int = 2, max_norm: float = 0.0):
    shard = PSShard(0, consistency, SGD, workers, LRS, max_norm)
    endpoint = serve(shard, "127.0.0.1", TOKEN)
    conn = GrpcConn(endpoint.address, TOKEN)
    conn.register({"w#0": torch.ones(4, 3), "b#0": torch.zeros(3)}, {}).result()
    return shard, endpoint, conn


@pytest.fixture
def bsp():
    shard, endpoint, conn = start("bsp")
    yield shard, endpoint, conn
    endpoint.server.stop(0)


def snapshot(shard: PSShard) -> dict:
    """Everything a request could change."""
    with shard.cond:
        return {"params": {k: v.clone() for k, v in shard.params.items()}, "version": shard.version,
                "applied_from": list(shard.applied_from), "sealed": shard.sealed, "reads": len(shard.reads),
                "staged": {c: {k: dict(w) for k, w in keys.items()} for c, keys in shard.staged.items()},
                "opts": {k: repr(o.state_dict()) for k, o in shard.opts.items()}}


def same(a: dict, b: dict) -> bool:
    return (a.keys() == b.keys() and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
            and all(a[k] == b[k] for k in a if k not in ("params", "staged"))
            and {c: {k: sorted(w) for k, w in v.items()} for c, v in a["staged"].items()}
            == {c: {k: sorted(w) for k, w in v.items()} for c, v in b["staged"].items()})


def stub(endpoint) -> ps_pb2_grpc.ParameterServerStub:
    return ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(endpoint.address))


def every_rpc():
    """One well-formed request per method."""
    grad = [to_msg("w#0", torch.full((4, 3), 1000.0)), to_msg("b#0", torch.full((3,), 1000.0))]
    return [("Register", ps_pb2.RegisterRequest(chunks=[to_msg("x#0", torch.ones(2))])),
            ("Push", ps_pb2.PushRequest(worker=0, clock=0, grads=grad)),
            ("GradSq", ps_pb2.GradSqRequest(clock=0, keys=["w#0"])),
            ("Apply", ps_pb2.ApplyRequest(clock=0, coef=1.0)),
            ("Pull", ps_pb2.PullRequest(keys=list(KEYS), worker=-1, clock=-1)),
            ("Clock", ps_pb2.ClockRequest())]


def test_every_call_without_the_token_is_unauthenticated_and_changes_nothing(bsp):
    shard, endpoint, _ = bsp
    before = snapshot(shard)
    raw = stub(endpoint)
    for metadata in ((), call_metadata("wrong"), (("authorization", TOKEN),)):
        for method, request in every_rpc():
            with pytest.raises(grpc.RpcError) as err:
                getattr(raw, method)(request, timeout=5, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
    assert same(snapshot(shard), before)
    reply = raw.Pull(ps_pb2.PullRequest(keys=list(KEYS), worker=-1, clock=-1), timeout=5,
                     metadata=call_metadata(TOKEN))  # with the token, the same call works
    assert reply.version == 0 and len(reply.chunks) == 2


def bsp_step(conn, clock: int, grads: list[dict], coef: float = 1.0) -> None:
    for worker, g in enumerate(grads):
        conn.push(worker, clock, g).result()
    conn.apply(clock, coef).result()


def test_bsp_steps_at_the_schedules_learning_rate(bsp):
    _shard, _, conn = bsp
    grads = [{"w#0": torch.full((4, 3), float(w + 1)), "b#0": torch.full((3,), float(w))} for w in range(2)]
    expected = {"w#0": torch.ones(4, 3), "b#0": torch.zeros(3)}
    for clock in range(2):
        bsp_step(conn, clock, grads)
        for key in KEYS:  # plain SGD: p -= lr(clock) * mean gradient
            expected[key] = expected[key] - LRS[clock] * (grads[0][key] + grads[1][key]) / 2
    pulled = conn.pull(list(KEYS), min_version=2).result()["chunks"]
    assert all(torch.allclose(pulled[k], expected[k]) for k in KEYS)


def test_the_wire_has_no_learning_rate_for_a_caller_to_set():
    assert "lr" not in ps_pb2.PushRequest.DESCRIPTOR.fields_by_name
    with pytest.raises(ValueError):
        ps_pb2.PushRequest(worker=0, clock=0, lr=50000.0)


def test_asp_steps_at_the_schedules_learning_rate():
    shard, endpoint, conn = start("asp", workers=1)
    try:
        grad = {"w#0": torch.ones(4, 3), "b#0": torch.ones(3)}
        reference = {k: v.clone() for k, v in shard.params.items()}
        for clock in range(3):
            conn.push(0, clock, grad).result()
            for key in KEYS:
                reference[key] -= LRS[clock] * grad[key]
        assert all(torch.allclose(shard.params[k], reference[k]) for k in KEYS)
    finally:
        endpoint.server.stop(0)


BAD_PUSHES = [
    ("phantom worker", dict(worker=2), "workers are 0 to 1"),
    ("negative worker", dict(worker=-1), "workers are 0 to 1"),
    ("huge worker", dict(worker=2**31 - 1), "workers are 0 to 1"),
    ("future clock", dict(clock=5), "clock 5 while at version 0"),
    ("negative clock", dict(clock=-1), "clock -1"),
    ("nan", dict(grads={"w#0": torch.full((4, 3), float("nan"))}), "inf or nan"),
    ("inf", dict(grads={"b#0": torch.tensor([0.0, float("inf"), 0.0])}), "inf or nan"),
    ("unknown key", dict(grads={"zz#0": torch.ones(3)}), "unknown key"),
    ("shape", dict(grads={"b#0": torch.ones(4)}), "expected shape"),
    ("dtype", dict(grads={"b#0": torch.ones(3, dtype=torch.float64)}), "expected shape"),
]


@pytest.mark.parametrize(("what", "change", "message"), BAD_PUSHES, ids=[b[0] for b in BAD_PUSHES])
def test_a_bad_push_is_refused_before_anything_is_staged(bsp, what, change, message):
    shard, _, conn = bsp
    before = snapshot(shard)
    args = {"worker": 0, "clock": 0, "grads": {"b#0": torch.ones(3)}, **change}
    with pytest.raises((ValueError, KeyError), match=message):
        conn.push(args["worker"], args["clock"], args["grads"]).result()
    assert same(snapshot(shard), before)


@pytest.mark.parametrize("coef", [float("inf"), float("nan"), 0.0, -1.0, 1.5])
def test_an_impossible_clipping_coefficient_applies_nothing(coef):
    shard, endpoint, conn = start("bsp", max_norm=1.0)
    try:
        grads = [{"w#0": torch.full((4, 3), 0.01), "b#0": torch.zeros(3)}] * 2
        for worker, g in enumerate(grads):
            conn.push(worker, 0, g).result()
        before = snapshot(shard)
        with pytest.raises(ValueError, match="coefficient"):
            conn.apply(0, coef).result()
        assert same(snapshot(shard), before)
    finally:
        endpoint.server.stop(0)


def test_a_coefficient_may_shrink_a_step_but_not_grow_it_past_the_shards_own_norm():
    shard, endpoint, conn = start("bsp", max_norm=1.0)
    try:
        big = [{"w#0": torch.full((4, 3), 10.0), "b#0": torch.zeros(3)}] * 2  # own norm ~34.6 > max_norm 1
        for worker, g in enumerate(big):
            conn.push(worker, 0, g).result()
        before = snapshot(shard)
        with pytest.raises(ValueError, match="above"):
            conn.apply(0, 1.0).result()  # unclipped: a step 35 times what the job allows
        assert same(snapshot(shard), before)
        conn.apply(0, 1.0 / 40).result()  # a norm counted over more shards is larger: a smaller coefficient
        assert shard.version == 1
    finally:
        endpoint.server.stop(0)


def test_a_late_register_cannot_add_a_key_every_worker_must_push(bsp):
    shard, _, conn = bsp
    conn.push(0, 0, {"b#0": torch.ones(3)}).result()
    before = snapshot(shard)
    with pytest.raises(ValueError, match="after training started"):
        conn.register({"extra#0": torch.ones(2)}, {}).result()
    with pytest.raises(ValueError, match="held as shape"):
        conn.register({"b#0": torch.ones(7)}, {}).result()
    assert same(snapshot(shard), before)
    conn.push(1, 0, {"b#0": torch.ones(3)}).result()
    conn.push(0, 0, {"w#0": torch.zeros(4, 3)}).result()
    conn.push(1, 0, {"w#0": torch.zeros(4, 3)}).result()
    conn.apply(0, 1.0).result()  # BSP was not stalled by the extra key
    assert shard.version == 1


def test_blocked_pulls_end_at_their_deadline_and_leave_the_shard_responsive(bsp):
    _shard, endpoint, conn = bsp
    raw, metadata = stub(endpoint), call_metadata(TOKEN)
    codes = []

    def blocked_pull():
        try:
            raw.Pull(ps_pb2.PullRequest(keys=["b#0"], min_version=1, worker=-1, clock=-1), timeout=1.0,
                     metadata=metadata)
        except grpc.RpcError as exc:
            codes.append(exc.code())

    threads = [threading.Thread(target=blocked_pull) for _ in range(32)]  # every server thread
    for t in threads:
        t.start()
    time.sleep(1.5)
    t0 = time.monotonic()
    assert conn.clock().result()["version"] == 0  # answered: no thread is still held
    assert time.monotonic() - t0 < 2.0
    for t in threads:
        t.join(10)
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 32
    with pytest.raises(ValueError, match="for version 7"):  # no legitimate caller waits more than a step ahead
        conn.pull(["b#0"], min_version=7).result()


def random_request(rng: random.Random):
    """A malformed or out-of-range request of a random kind."""
    tensor = rng.choice([
        ps_pb2.Tensor(key="b#0", dtype="float32", shape=[3], data=b"\x00" * 5),
        ps_pb2.Tensor(key="b#0", dtype="nn", shape=[3], data=b"\x00" * 12),
        ps_pb2.Tensor(key="b#0", dtype="float32", shape=[-3], data=b""),
        ps_pb2.Tensor(key="b#0", dtype="__class__", shape=[1], data=b"\x00" * 4),
        to_msg("b#0", torch.tensor([float("nan"), 0.0, 0.0])),
        to_msg("b#0", torch.ones(3, dtype=torch.int64)),
        to_msg("b#" + "9" * rng.randint(1, 30), torch.ones(3)),
        to_msg("w#0", torch.ones(3, 4)),
    ])
    worker = rng.choice([-(2**31), -2, 2, 3, 2**31 - 1])
    clock = rng.choice([-(2**63), -1, 1, 2**40])
    return rng.choice([
        ("Push", ps_pb2.PushRequest(worker=rng.choice([0, 1, worker]), clock=rng.choice([0, clock]),
                                    grads=[tensor])),
        ("Push", ps_pb2.PushRequest(worker=worker, clock=0, grads=[to_msg("b#0", torch.ones(3))])),
        ("Register", ps_pb2.RegisterRequest(chunks=[tensor], layout_json=rng.choice(["[1]", "{", '"x"']))),
        ("GradSq", ps_pb2.GradSqRequest(clock=clock, keys=["b#0"])),
        ("GradSq", ps_pb2.GradSqRequest(clock=0, keys=["nope#0"])),
        ("Apply", ps_pb2.ApplyRequest(clock=clock, coef=1.0)),
        ("Apply", ps_pb2.ApplyRequest(clock=0, coef=rng.choice([float("nan"), float("inf"), -1.0, 0.0, 9.0]))),
        ("Pull", ps_pb2.PullRequest(keys=["b#0"], min_version=clock, worker=worker, clock=0)),
        ("Pull", ps_pb2.PullRequest(keys=["nope#0"], worker=-1, clock=-1)),
    ])


def test_fuzzed_requests_with_the_token_are_refused_and_change_nothing(bsp):
    shard, endpoint, conn = bsp
    for worker in range(2):  # clock 0 fully pushed, not applied: the state a bad Apply would love to act on
        conn.push(worker, 0, {"b#0": torch.ones(3), "w#0": torch.ones(4, 3)}).result()
    before = snapshot(shard)
    raw, metadata, rng = stub(endpoint), call_metadata(TOKEN), random.Random(13)
    refused = 0
    for _ in range(300):
        method, request = random_request(rng)
        try:
            getattr(raw, method)(request, timeout=2, metadata=metadata)
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED), exc
            refused += 1
    assert refused == 300
    assert same(snapshot(shard), before)
    conn.apply(0, 1.0).result()  # and the real step still goes through
    assert shard.version == 1 and torch.allclose(shard.params["b#0"], torch.full((3,), -LRS[0]))


# -- TLS (parameter_server.tls_cert / tls_key): the same rule as the control API's -------------------------------


@pytest.fixture(scope="module")
def pems():
    """The shards' certificate and key for 127.0.0.1, and an unrelated certificate (another job's)."""
    return (*self_signed(), self_signed()[0])


def tls_start(pems):
    """A bsp shard serving TLS only with the first certificate, registered over TLS."""
    cert, key, _ = pems
    return start_with_layout((cert, key))


def start_with_layout(tls=None):
    """A bsp shard holding a whole layout (what an outside reader reads), TLS only with ``tls``."""
    shard = PSShard(0, "bsp", SGD, 2, LRS, 0.0)
    endpoint = serve(shard, "127.0.0.1", TOKEN, tls=tls)
    layout = {"w": {"shape": [4, 3], "dtype": "float32"}, "b": {"shape": [3], "dtype": "float32"}}
    root = tls[0] if tls else None
    GrpcConn(endpoint.address, TOKEN, root).register({"w#0": torch.ones(4, 3), "b#0": torch.zeros(3)}, layout).result()
    return shard, endpoint


def test_a_tls_shard_serves_a_client_trusting_its_certificate_and_no_other(pems):
    cert, _, other = pems
    shard, endpoint = tls_start(pems)
    try:
        before = snapshot(shard)
        with pytest.raises(ShardDown):  # plaintext: no handshake, no call
            GrpcConn(endpoint.address, TOKEN, None).push(0, 0, {"b#0": torch.ones(3)}).result()
        with pytest.raises(CertificateRefused, match="parameter_server.tls_cert must name 127.0.0.1"):
            GrpcConn(endpoint.address, TOKEN, other).push(0, 0, {"b#0": torch.ones(3)}).result()  # not trusted
        with pytest.raises(grpc.RpcError) as err:  # a raw plaintext call with the token
            stub(endpoint).Clock(ps_pb2.ClockRequest(), timeout=5, metadata=call_metadata(TOKEN))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert same(snapshot(shard), before)
        conn = GrpcConn(endpoint.address, TOKEN, cert)
        bsp_step(conn, 0, [{"b#0": torch.ones(3), "w#0": torch.zeros(4, 3)}] * 2)
        assert torch.allclose(conn.pull(["b#0"], min_version=1).result()["chunks"]["b#0"], torch.full((3,), -LRS[0]))
    finally:
        endpoint.server.stop(0)


def test_the_outside_reader_dials_tls_as_the_routes_file_says(pems, tmp_path, monkeypatch):
    cert, _, other = pems
    _shard, endpoint = tls_start(pems)
    try:
        (tmp_path / TOKEN_FILE).write_text(TOKEN)
        (tmp_path / "tls.pem").write_bytes(cert)
        (tmp_path / "other.pem").write_bytes(other)
        routes = tmp_path / ROUTES_FILE  # as PSShards._write_routes writes it for a TLS wire
        write_routes(tmp_path, {"addresses": [endpoint.address], "vnodes": 16, "chunk_elems": 1 << 16,
                                "token": str(tmp_path / TOKEN_FILE), "tls_cert": str(tmp_path / "tls.pem")})
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        monkeypatch.delenv(TLS_CA_ENV, raising=False)
        assert torch.equal(pull_parameters(routes)["w"], torch.ones(4, 3))
        monkeypatch.setenv(TLS_CA_ENV, str(tmp_path / "other.pem"))  # the override wins, and is not trusted
        with pytest.raises(CertificateRefused, match=f"CERTIFICATE_VERIFY_FAILED.*fix: .*{TLS_CA_ENV}"):
            pull_parameters(routes)
        monkeypatch.setenv(TLS_CA_ENV, str(tmp_path / "missing.pem"))
        with pytest.raises(PermissionError, match=f"shards .*missing.pem is not readable.*fix: point {TLS_CA_ENV}"):
            pull_parameters(routes)
    finally:
        endpoint.server.stop(0)


def test_the_reader_sends_the_token_beside_the_routes_file_never_a_file_they_name(tmp_path, monkeypatch):
    """Before: the reader read whatever path the routes file's ``token`` named (any one-line file of the user's,
    e.g. a cloud credential) and sent its content as the bearer token to the addresses the file names."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    _shard, endpoint = start_with_layout()
    try:
        (tmp_path / TOKEN_FILE).write_text(TOKEN)
        (tmp_path / "credential").write_text("someone-elses-secret")
        write_routes(tmp_path, {"addresses": [endpoint.address], "vnodes": 16, "chunk_elems": 1 << 16,
                                "token": str(tmp_path / "credential")})
        assert torch.equal(pull_parameters(tmp_path / ROUTES_FILE)["w"], torch.ones(4, 3))
    finally:
        endpoint.server.stop(0)


def _tamper(kind: str, routes, monkeypatch) -> None:
    """What someone else leaves of the routes file: it then points the reader (and its token) where they like."""
    if kind == "symlink":
        routes.rename(routes.with_name("theirs.json"))
        routes.symlink_to(routes.with_name("theirs.json"))
    elif kind == "another user's file":
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    else:
        routes.chmod({"group-writable": 0o664, "world-writable": 0o646}[kind])


@pytest.mark.parametrize("kind", ["group-writable", "world-writable", "another user's file", "symlink"])
def test_a_routes_file_someone_else_may_change_is_refused_before_any_call(tmp_path, monkeypatch, kind):
    """Before: the reader trusted any routes file, so whoever could write it sent the reader, and the job's token
    (or Ray's cluster token), to an address of theirs."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    (tmp_path / TOKEN_FILE).write_text(TOKEN)
    write_routes(tmp_path, {"addresses": ["127.0.0.1:1"], "vnodes": 16, "chunk_elems": 1 << 16,
                            "token": str(tmp_path / TOKEN_FILE)})
    routes = tmp_path / ROUTES_FILE
    _tamper(kind, routes, monkeypatch)
    with pytest.raises(PermissionError, match=f"routes file {routes} .*; fix: read the one the job's controller"):
        pull_parameters(routes)  # refused before dialling: nothing listens at 127.0.0.1:1 (ShardDown otherwise)


def test_routes_are_written_for_the_user_alone_to_change_whatever_the_umask(tmp_path):
    """Under a umask of 002 (user-private groups) a plain write left the file group-writable; a link planted at
    its name is replaced, its target left alone."""
    victim = tmp_path / "victim"
    victim.write_text("mine")
    (tmp_path / ROUTES_FILE).symlink_to(victim)
    old = os.umask(0o002)
    try:
        write_routes(tmp_path, {"addresses": ["127.0.0.1:5"]})
    finally:
        os.umask(old)
    routes = tmp_path / ROUTES_FILE
    assert not routes.is_symlink() and stat.S_IMODE(routes.stat().st_mode) == 0o644 and victim.read_text() == "mine"
    assert read_routes(routes) == {"addresses": ["127.0.0.1:5"]}


def test_a_certificate_that_does_not_name_the_shards_address_is_refused_naming_the_field_and_address():
    """The shards listen on the node's address; a certificate for another one fails the handshake. The caller is
    told so (not that every shard is down, which failing over would conclude), and the controller's check at
    start says the same; an address with nothing listening is left to the ranks."""
    cert, key = self_signed("10.9.9.9")
    shard = PSShard(0, "bsp", SGD, 2, LRS, 0.0)
    endpoint = serve(shard, "127.0.0.1", TOKEN, tls=(cert, key))
    try:
        before = snapshot(shard)
        fix = rf"{endpoint.address} refused \(.*Hostname Verification.*\); fix: parameter_server.tls_cert must name " \
              r"127.0.0.1 among its subject alternative names"
        with pytest.raises(CertificateRefused, match=fix):
            GrpcConn(endpoint.address, TOKEN, cert).push(0, 0, {"b#0": torch.ones(3)}).result()
        with pytest.raises(CertificateRefused, match=fix):
            check_handshake(endpoint.address, TOKEN, cert)
        assert same(snapshot(shard), before)
    finally:
        endpoint.server.stop(0)
    good, good_key = self_signed()
    endpoint = serve(PSShard(0, "bsp", SGD, 2, LRS, 0.0), "127.0.0.1", TOKEN, tls=(good, good_key))
    try:
        check_handshake(endpoint.address, TOKEN, good)  # the right certificate: passes
    finally:
        endpoint.server.stop(0)
    check_handshake(endpoint.address, TOKEN, good, timeout_s=2)  # nothing listens now: not a certificate error


PS_JOB = {"data": {"path": "d"}, "parallel": {"dp": 2, "dp_sync": "ps"}}


@pytest.mark.parametrize("section", ["control", "parameter_server"])
@pytest.mark.parametrize(("given", "missing"), [("tls_cert", "tls_key"), ("tls_key", "tls_cert")])
def test_a_certificate_without_its_key_is_refused_alike_in_both_sections(section, given, missing):
    err = spec_error({**PS_JOB, section: {given: "x.pem"}})
    assert_actionable(err, f"{section}.{missing}", None, f"set {section}.{missing}", f"remove {section}.{given}")


def test_shard_tls_without_shards_is_refused():
    err = spec_error({"data": {"path": "d"}, "parameter_server": {"tls_cert": "c.pem", "tls_key": "k.pem"}})
    assert_actionable(err, "parameter_server.tls_cert", "c.pem", "set parallel.dp_sync: ps", "remove")


def test_shard_tls_paths_resolve_like_the_control_apis(tmp_path, monkeypatch):
    job = tmp_path / "job.yaml"
    job.write_text("data: {path: d}\nparallel: {dp: 2, dp_sync: ps}\n"
                   "parameter_server: {tls_cert: pki/ps.pem, tls_key: pki/ps.key}\n")
    monkeypatch.chdir(tmp_path)
    ps = load_spec(job).parameter_server
    assert (ps.tls_cert, ps.tls_key) == (str(tmp_path / "pki/ps.pem"), str(tmp_path / "pki/ps.key"))
    with pytest.raises(FileNotFoundError, match=r"parameter_server.tls_cert .*ps.pem cannot be read.*fix"):
        read_pair("parameter_server", ps.tls_cert, ps.tls_key)
