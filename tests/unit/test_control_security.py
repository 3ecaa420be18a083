"""The control API is closed by default: loopback only, a token on every call, TLS when asked, every request checked,
and event lines no caller can forge. A real gRPC server with a fake controller; no Ray."""

from __future__ import annotations

import os
import re
import socket
import stat
import threading

import grpc
import pytest

from orchestrator.api import auth
from orchestrator.api.control_server import ControlClient, ControlServer, ControlUnreachable
from orchestrator.api.proto import control_pb2, control_pb2_grpc
from orchestrator.client import control_address, control_client
from orchestrator.events import escape, parse_event
from orchestrator.spec import JobSpec
from parameter_server.errors import CertificateRefused
from tests.support.tls import self_signed

TOKEN = "s3cret-token"


class RecordingController:
    """Counts every call that reached it: a refused request must leave all of these empty."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def status(self) -> dict:
        self.calls.append(("status",))
        return {"job": "j", "state": "running", "step": 3, "total_steps": 9}

    def request_stop(self, reason: str) -> str:
        self.calls.append(("stop", reason))
        return "stopping"

    def inject_fault(self, kind: str, rank: int, factor: float) -> int:
        self.calls.append(("fault", kind, rank, factor))
        return 4

    def request_scale(self, dp: int) -> int:
        self.calls.append(("scale", dp))
        return 3


@pytest.fixture
def served():
    controller = RecordingController()
    server = ControlServer(controller, TOKEN)
    yield controller, server
    server.close()


def raw_stop(address: str, metadata=()) -> grpc.StatusCode:
    """A hand-made Stop call with the generated stub (what an outsider would send); its status code."""
    with grpc.insecure_channel(address) as channel:
        try:
            control_pb2_grpc.ControlStub(channel).Stop(control_pb2.StopRequest(reason="x"), timeout=5,
                                                       metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_a_call_without_the_token_is_unauthenticated_and_changes_nothing(served):
    controller, server = served
    assert raw_stop(server.address) == grpc.StatusCode.UNAUTHENTICATED
    assert raw_stop(server.address, (("authorization", "Bearer wrong"),)) == grpc.StatusCode.UNAUTHENTICATED
    assert raw_stop(server.address, (("authorization", TOKEN),)) == grpc.StatusCode.UNAUTHENTICATED  # no Bearer
    with pytest.raises(PermissionError, match="UNAUTHENTICATED|authentication token"):
        ControlClient(server.address, "wrong").inject_fault("kill_rank", 0)
    assert controller.calls == []
    assert raw_stop(server.address, (("authorization", f"Bearer {TOKEN}"),)) == grpc.StatusCode.OK
    assert controller.calls == [("stop", "x")]


def test_callers_without_the_token_cannot_hold_the_servers_threads(served):
    """Calls that send their metadata but never their message, more of them than the server has threads: each
    is refused at once, without waiting for the message, and the token holder is still answered."""
    controller, server = served
    release = threading.Event()

    def never_sends():
        release.wait()
        yield from ()

    channels = [grpc.insecure_channel(server.address) for _ in range(6)]
    try:
        held = [ch.stream_unary("/raymesh.control.Control/Stop", request_serializer=bytes,
                                response_deserializer=bytes).future(never_sends()) for ch in channels]
        assert ControlClient(server.address, TOKEN, timeout_s=10).stop("mine")["state"] == "stopping"
        assert controller.calls == [("stop", "mine")]
        codes = [_code(call) for call in held]
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * len(held)  # refused with the message still unsent
    finally:
        release.set()
        for ch in channels:
            ch.close()


def _code(call) -> grpc.StatusCode:
    try:
        call.result(timeout=10)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def non_loopback_ip() -> str:
    """This machine's address on its default route (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: routed like any outside address, never answered
        return s.getsockname()[0]


def test_it_listens_on_loopback_only_by_default(served):
    _, server = served
    host, port = server.address.rsplit(":", 1)
    assert host == "127.0.0.1"
    outside = non_loopback_ip()
    assert not outside.startswith("127.")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((outside, int(port)), timeout=5).close()


def test_a_widened_plaintext_api_says_so_in_its_announcement(served):
    """``control.host`` beyond loopback without TLS is the user's choice, but the ``event=control`` line says the
    token travels in clear and how to fix it; on loopback, or with TLS, it says nothing of the kind."""
    _, server = served
    assert "warning" not in server.announcement()
    wide = ControlServer(RecordingController(), TOKEN, host=non_loopback_ip())
    try:
        assert "clear text" in wide.announcement()["warning"] and "control.tls_cert" in wide.announcement()["warning"]
    finally:
        wide.close()
    cert, key = self_signed(non_loopback_ip())
    secured = ControlServer(RecordingController(), TOKEN, host=non_loopback_ip(), tls=(cert, key), cert_path="c.pem")
    try:
        assert "warning" not in secured.announcement() and secured.announcement()["tls_cert"] == "c.pem"
    finally:
        secured.close()


BAD_REQUESTS = [
    ("inject_fault", ("slow_rank", 0, float("inf")), "finite number > 1"),
    ("inject_fault", ("slow_rank", 0, float("nan")), "finite number > 1"),
    ("inject_fault", ("slow_rank", 0, 0.5), "finite number > 1"),
    ("inject_fault", ("kill_ps_shard", 0, 3.0), "cannot be injected into a running job"),
    ("inject_fault", ("format_disk", 0, 3.0), "cannot be injected into a running job"),
    ("inject_fault", ("kill_rank", -1, 3.0), "negative"),
    ("request_scale", (0,), "below 1"),
    ("request_scale", (-4,), "below 1"),
    ("stop", ("x" * 501,), "keep it under 500"),
]


@pytest.mark.parametrize(("method", "args", "message"), BAD_REQUESTS, ids=[f"{m}{a}"[:40] for m, a, _ in BAD_REQUESTS])
def test_a_bad_request_is_invalid_argument_and_changes_nothing(served, method, args, message):
    controller, server = served
    with pytest.raises(ValueError, match=message):
        getattr(ControlClient(server.address, TOKEN), method)(*args)
    assert controller.calls == []


def test_live_faults_can_be_switched_off():
    controller = RecordingController()
    server = ControlServer(controller, TOKEN, allow_faults=False)
    try:
        with pytest.raises(PermissionError, match="control.allow_faults"):
            ControlClient(server.address, TOKEN).inject_fault("kill_rank", 0)
        assert controller.calls == []
        assert ControlClient(server.address, TOKEN).request_scale(2) == 3  # the rest still works
    finally:
        server.close()


def test_tls_serves_a_client_that_trusts_the_certificate_and_no_plaintext_client():
    cert, key = self_signed()
    controller = RecordingController()
    server = ControlServer(controller, TOKEN, tls=(cert, key))
    try:
        assert ControlClient(server.address, TOKEN, root_cert=cert).status()["step"] == 3
        with pytest.raises(ControlUnreachable):
            ControlClient(server.address, TOKEN, timeout_s=2).status()
        with pytest.raises(CertificateRefused, match=r"fix: control.tls_cert must name 127.0.0.1 among"):
            ControlClient(server.address, TOKEN, timeout_s=2, root_cert=self_signed()[0]).status()  # another one
        assert controller.calls == [("status",)]
    finally:
        server.close()
    cert, key = self_signed("10.9.9.9")  # a certificate for another address than the one the API announces
    server = ControlServer(controller, TOKEN, tls=(cert, key))
    try:
        with pytest.raises(CertificateRefused, match=r"Hostname Verification.*fix: control.tls_cert must name"):
            ControlClient(server.address, TOKEN, timeout_s=2, root_cert=cert).status()
        assert controller.calls == [("status",)]
    finally:
        server.close()


def test_the_per_job_secret_is_private_stable_and_read_by_the_client(tmp_path, monkeypatch):
    monkeypatch.setattr(auth, "ray_token_auth_on", lambda: False)
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    first, again = auth.job_token(tmp_path / "run"), auth.job_token(tmp_path / "run")
    path = tmp_path / "run" / auth.TOKEN_FILE
    assert first == again and first.source == str(path) and len(first.value) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)  # a copied run directory
    assert auth.job_token(tmp_path / "run") == first and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert first.value not in repr(first)
    assert auth.client_token(first.source) == first.value
    monkeypatch.setenv(auth.TOKEN_ENV, "from-env")
    assert auth.client_token(first.source) == "from-env"
    monkeypatch.delenv(auth.TOKEN_ENV)
    with pytest.raises(PermissionError, match=auth.TOKEN_ENV):
        auth.client_token(str(tmp_path / "elsewhere" / auth.TOKEN_FILE))


def _plant(kind: str, path, victim, monkeypatch) -> None:
    """What someone who may write the run directory leaves at ``path``, its control_token, before the job starts."""
    if kind == "symlink":
        path.symlink_to(victim)
    elif kind == "hard link":
        os.link(victim, path)
    elif kind == "directory":
        path.mkdir()
    else:  # their own file: this process plays another user
        path.write_text("known-to-the-planter")
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)


@pytest.mark.parametrize("kind", ["symlink", "hard link", "directory", "another user's file"])
def test_a_planted_token_file_is_refused_and_its_target_left_alone(tmp_path, monkeypatch, kind):
    """Before: the job chmod-ed a link's target to 0600 and took its content, which the planter knows, as the
    secret, and a client sent it as the token."""
    monkeypatch.setattr(auth, "ray_token_auth_on", lambda: False)
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    victim = tmp_path / "victim"
    victim.write_text("known-to-the-planter")
    victim.chmod(0o644)
    path = tmp_path / "run" / auth.TOKEN_FILE
    path.parent.mkdir()
    _plant(kind, path, victim, monkeypatch)
    with pytest.raises(PermissionError, match=f"{re.escape(str(path))} .*; fix: delete it; the job makes a new one"):
        auth.job_token(tmp_path / "run")
    with pytest.raises(PermissionError, match=f"{re.escape(str(path))} .*; fix: .*{auth.TOKEN_ENV}"):
        auth.client_token(str(path))
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644 and victim.read_text() == "known-to-the-planter"


def test_a_stop_reason_cannot_forge_the_control_line(served):
    _controller, server = served
    real = f"12:00:00 raymesh event=control address={server.address} token=ray"
    forged = "x event=control address=6.6.6.6:1\n12:00:02 raymesh event=control address=6.6.6.6:1 token=ray"
    log = "\n".join([real, f"12:00:01 raymesh event=stop_requested job=j reason={escape(forged)} step=3"])
    assert len(log.splitlines()) == 2  # the newline in the reason stayed inside its value
    assert control_address(log) == server.address
    assert parse_event(log.splitlines()[1]) == ("stop_requested", {"job": "j", "reason": forged, "step": "3"})


def test_the_client_dials_what_the_job_announced_with_its_token(served, tmp_path, monkeypatch):
    _controller, server = served
    token_file = tmp_path / auth.TOKEN_FILE
    token_file.write_text(TOKEN)
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    log = f"12:00:00 raymesh event=control address={server.address} token={token_file}"
    assert control_client(log).status()["step"] == 3


@pytest.mark.parametrize(("faults", "control", "allowed"), [
    ([], {}, False), ([{"kind": "kill_rank", "at_step": 2}], {}, True), ([], {"allow_faults": True}, True),
    ([{"kind": "kill_rank", "at_step": 2}], {"allow_faults": False}, False)])
def test_live_faults_default_on_only_with_a_faults_section(tmp_path, monkeypatch, faults, control, allowed):
    monkeypatch.setattr(auth, "ray_token_auth_on", lambda: False)
    spec = JobSpec.from_dict({"data": {"path": "d"}, "train": {"steps": 5}, "faults": faults, "control": control})
    job = RecordingController()
    job.spec, job.run_dir = spec, tmp_path
    server = ControlServer.for_job(job)
    try:
        assert server.address.startswith("127.0.0.1:")
        client = ControlClient(server.address, auth.job_token(tmp_path).value)
        if allowed:
            assert client.inject_fault("kill_rank", 0) == 4
        else:
            with pytest.raises(PermissionError, match="allow_faults"):
                client.inject_fault("kill_rank", 0)
            assert job.calls == []
    finally:
        server.close()


def test_a_live_fault_is_checked_against_the_whole_job_like_a_job_file_entry():
    from orchestrator.runtime.controller import validated_fault

    ps = JobSpec.from_dict({"data": {"path": "d"}, "train": {"steps": 5},
                            "parallel": {"dp": 2, "dp_sync": "ps"}})
    with pytest.raises(ValueError, match="not recoverable with parallel.dp_sync: ps"):
        validated_fault({"kind": "hang_rank", "rank": 1, "at_step": 2, "factor": 3.0}, ps, None, None)
    with pytest.raises(ValueError, match="after the last step 5"):
        validated_fault({"kind": "slow_rank", "rank": 1, "at_step": 6, "factor": 3.0}, ps, None, None)
    assert validated_fault({"kind": "slow_rank", "rank": 1, "at_step": 2, "factor": 3.0}, ps, None, None)["rank"] == 1
