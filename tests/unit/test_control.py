"""The control API over a real gRPC server with a fake controller: no Ray needed."""

from __future__ import annotations

import socket
import time

import pytest

from orchestrator.api.control_server import ControlClient, ControlServer, ControlUnreachable

TOKEN = "unit-test-token"

LAYOUT = {"dp": 2, "pp": 2, "tp": 2, "ranks": [{"rank": 0, "coords": [0, 0, 0]}]}


class FakeController:
    def __init__(self) -> None:
        self.state = "running"
        self.stop_reasons: list[str] = []

    def status(self) -> dict:
        return {
            "job": "gpt-tiny-3d", "state": self.state, "step": 12, "total_steps": 200, "loss": 4.25,
            "tokens_per_s": 1234.5, "layout": LAYOUT, "health": {0: 0.25, 7: 1.5}, "started_unix": 1.7e9,
        }

    def request_stop(self, reason: str) -> str:
        self.stop_reasons.append(reason)
        if self.state == "running":
            self.state = "stopping"
        return self.state


@pytest.fixture
def served():
    controller = FakeController()
    server = ControlServer(controller, TOKEN)
    yield controller, server
    server.close()


def test_status_round_trip(served):
    _, server = served
    status = ControlClient(server.address, TOKEN).status()
    assert status == {
        "job": "gpt-tiny-3d", "state": "running", "step": 12, "total_steps": 200, "loss": 4.25,
        "tokens_per_s": 1234.5, "layout": LAYOUT, "health": {0: 0.25, 7: 1.5}, "started_unix": 1.7e9,
    }


def test_loss_before_the_first_step_is_none(served):
    controller, server = served
    controller.status = lambda: {"job": "j", "state": "starting", "step": 0, "total_steps": 5, "loss": None}
    status = ControlClient(server.address, TOKEN).status()
    assert status["loss"] is None and status["state"] == "starting" and status["layout"] == {}


def test_stop_is_accepted_once_then_reports_the_state(served):
    controller, server = served
    client = ControlClient(server.address, TOKEN)
    assert client.stop("user asked") == {"accepted": True, "state": "stopping"}
    assert controller.stop_reasons == ["user asked"]
    assert client.status()["state"] == "stopping"
    controller.state = "finished"
    assert client.stop() == {"accepted": False, "state": "finished"}
    controller.state = "starting"  # the stop takes effect after the first step
    assert client.stop() == {"accepted": True, "state": "starting"}


def test_handler_failure_is_reported_with_its_cause(served):
    controller, server = served
    controller.status = lambda: {"job": "j", "steps": 3}
    with pytest.raises(RuntimeError, match=r"controller status failed: ValueError: .*unknown key\(s\) \['steps'\]"):
        ControlClient(server.address, TOKEN).status()


def test_listening_on_all_interfaces_advertises_a_reachable_host():
    server = ControlServer(FakeController(), TOKEN, host="0.0.0.0")
    try:
        host, port = server.address.rsplit(":", 1)
        assert host != "0.0.0.0" and int(port) > 0
        assert ControlClient(server.address, TOKEN).status()["step"] == 12
    finally:
        server.close()


def test_unreachable_address_names_it_and_what_to_check():
    with socket.socket() as s:  # a port that was free a moment ago and has no listener now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    t0 = time.monotonic()
    with pytest.raises(ControlUnreachable) as info:
        ControlClient(address, TOKEN, timeout_s=2).status()
    assert time.monotonic() - t0 < 10
    message = str(info.value)
    assert address in message and "still running" in message and "event=control address=" in message


def test_closed_server_is_unreachable(served):
    _, server = served
    server.close()
    with pytest.raises(ControlUnreachable, match=server.address):
        ControlClient(server.address, TOKEN, timeout_s=2).stop()
