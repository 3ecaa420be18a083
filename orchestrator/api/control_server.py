"""The controller's control API over gRPC: ask a running job for its status, ask it to stop, inject a fault, resize it.

The controller runs inside a Ray actor (or a driver process), which has no port
of its own that a user could reach; ``ControlServer`` opens one and the
controller announces ``address`` in its log (``event=control address=HOST:PORT``,
which a following ``raymesh run`` prints into a submitted job's log) and
through its hosting actor, where ``orchestrator.api.client.Client`` finds it.
"""

from __future__ import annotations

import json
import socket
import sys
from concurrent import futures
from typing import Any, Protocol

import grpc

from orchestrator.api.proto import control_pb2, control_pb2_grpc

DEFAULT_TIMEOUT_S = 5.0
_STATUS_FIELDS = frozenset(control_pb2.StatusReply.DESCRIPTOR.fields_by_name)


class ControlHandler(Protocol):
    """What the server asks of the controller."""

    def status(self) -> dict[str, Any]:
        """Keys are ``StatusReply`` field names; ``layout`` is a dict, ``loss`` may be None."""

    def request_stop(self, reason: str) -> str:
        """Start a graceful stop and return the job state after the request.

        Any state but ``finished`` or ``failed`` counts as accepted: a stop asked
        for while ``starting`` takes effect after the first step.
        """


    def inject_fault(self, kind: str, rank: int, factor: float) -> int:
        """Schedule a fault for the next step and return that step; ``ValueError`` for a bad request."""


    def request_scale(self, dp: int) -> int:
        """Resize data parallelism after the current step and return that step; ``ValueError`` if refused."""


class ControlUnreachable(ConnectionError):
    """The control API did not answer: the job ended, has not started it yet, or a network is in the way."""


def _reply(status: dict[str, Any]) -> control_pb2.StatusReply:
    unknown = set(status) - _STATUS_FIELDS
    if unknown:
        raise ValueError(f"status() returned unknown key(s) {sorted(unknown)}; use only {sorted(_STATUS_FIELDS)}")
    fields = dict(status)
    fields["layout"] = json.dumps(fields.get("layout") or {}, default=str)
    fields["health"] = {int(rank): float(age) for rank, age in (fields.get("health") or {}).items()}
    if fields.get("loss") is None:
        fields.pop("loss", None)
    return control_pb2.StatusReply(**fields)


def status_dict(reply: control_pb2.StatusReply) -> dict[str, Any]:
    """The reply as the dict a handler returns (layout parsed, loss None when unset)."""
    return {
        "job": reply.job,
        "state": reply.state,
        "step": reply.step,
        "total_steps": reply.total_steps,
        "loss": reply.loss if reply.HasField("loss") else None,
        "tokens_per_s": reply.tokens_per_s,
        "layout": json.loads(reply.layout) if reply.layout else {},
        "health": dict(reply.health),
        "started_unix": reply.started_unix,
    }


class _Servicer(control_pb2_grpc.ControlServicer):
    def __init__(self, handler: ControlHandler) -> None:
        self._handler = handler

    def Status(self, request: control_pb2.StatusRequest, context: grpc.ServicerContext) -> control_pb2.StatusReply:
        try:
            return _reply(self._handler.status())
        except Exception as exc:  # report the controller's fault to the caller instead of a bare UNKNOWN
            context.abort(grpc.StatusCode.INTERNAL, f"controller status failed: {type(exc).__name__}: {exc}")

    def Stop(self, request: control_pb2.StopRequest, context: grpc.ServicerContext) -> control_pb2.StopReply:
        try:
            state = self._handler.request_stop(request.reason)
        except Exception as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"controller stop failed: {type(exc).__name__}: {exc}")
        return control_pb2.StopReply(accepted=state not in ("finished", "failed"), state=state)


    def InjectFault(self, request: control_pb2.FaultRequest, context: grpc.ServicerContext) -> control_pb2.FaultReply:
        try:
            at_step = self._handler.inject_fault(request.kind, request.rank, request.factor or 3.0)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return control_pb2.FaultReply(at_step=at_step)


    def RequestScale(self, request: control_pb2.ScaleRequest, context: grpc.ServicerContext) -> control_pb2.ScaleReply:
        try:
            after_step = self._handler.request_scale(request.dp)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return control_pb2.ScaleReply(after_step=after_step)


def _advertised_host(host: str) -> str:
    if host not in ("0.0.0.0", "::", "[::]", ""):
        return host
    ray = sys.modules.get("ray")  # not imported means not initialized; spares the import
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())


class ControlServer:
    """Serves ``handler`` on a background thread pool until ``close()``.

    ``port=0`` takes a free port; ``address`` is what another machine dials
    (the node IP when listening on all interfaces).
    """

    def __init__(self, handler: ControlHandler, host: str = "0.0.0.0", port: int = 0) -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="raymesh-control"))
        control_pb2_grpc.add_ControlServicer_to_server(_Servicer(handler), self._server)
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"control API cannot listen on {host}:{port}; fix: pick a free port or port=0")
        self._server.start()
        self.address = f"{_advertised_host(host)}:{bound}"

    def close(self, grace_s: float = 1.0) -> None:
        """Stop serving; calls in flight get ``grace_s`` to finish."""
        self._server.stop(grace_s).wait()


class ControlClient:
    """Calls one controller's control API; every call fails after ``timeout_s`` with ``ControlUnreachable``."""

    def __init__(self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.address = address
        self.timeout_s = timeout_s

    def status(self) -> dict[str, Any]:
        return status_dict(self._call("Status", control_pb2.StatusRequest()))

    def stop(self, reason: str = "") -> dict[str, Any]:
        reply = self._call("Stop", control_pb2.StopRequest(reason=reason))
        return {"accepted": reply.accepted, "state": reply.state}

    def inject_fault(self, kind: str, rank: int, factor: float = 3.0) -> int:
        """The step at which the fault fires; ``ValueError`` when the controller refuses the request."""
        return self._call("InjectFault", control_pb2.FaultRequest(kind=kind, rank=rank, factor=factor)).at_step

    def request_scale(self, dp: int) -> int:
        """The step after which the job continues at data-parallel degree ``dp``."""
        return self._call("RequestScale", control_pb2.ScaleRequest(dp=dp)).after_step

    def _call(self, method: str, request):
        # One channel per call: calls are rare and this leaves nothing open between them.
        with grpc.insecure_channel(self.address) as channel:
            rpc = getattr(control_pb2_grpc.ControlStub(channel), method)
            try:
                return rpc(request, timeout=self.timeout_s)
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise ControlUnreachable(
                        f"cannot reach the raymesh control API at {self.address} "
                        f"({exc.code().name} after at most {self.timeout_s:g}s: {exc.details()}); check that the "
                        f"job is still running (`raymesh status ID`), that {self.address} is the newest "
                        "`event=control address=...` line in its log, and that this machine can reach that "
                        "node's port"
                    ) from None
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise ValueError(exc.details()) from None
                raise RuntimeError(f"control API at {self.address}: {method} failed: {exc.details()}") from None
