"""The controller's control API over gRPC: ask a running job for its status, ask it to stop, inject a fault, resize it.

The controller runs inside a Ray actor (or a driver process), which has no port
of its own that a user could reach; ``ControlServer`` opens one and the
controller announces it in its log (``event=control address=HOST:PORT
token=SOURCE``, which a following ``raymesh run`` prints into a submitted job's
log) and through its hosting actor, where ``orchestrator.client.Client``
finds it.

Closed by default: it listens on 127.0.0.1 unless the job file's ``control.host``
widens it, every call must carry the job's token (``orchestrator/api/auth.py``;
otherwise UNAUTHENTICATED before any handler runs), TLS is on when the job file
names a certificate, and each request is checked like a job-file entry before
the controller acts (INVALID_ARGUMENT otherwise).
"""

from __future__ import annotations

import json
import math
import socket
import sys
from concurrent import futures
from typing import Any, Protocol

import grpc

from orchestrator.api.proto import control_pb2, control_pb2_grpc
from parameter_server import tls as tls_wire
from parameter_server.auth import TokenInterceptor, call_metadata, client_token

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


LIVE_FAULT_KINDS = ("kill_rank", "kill_node", "hang_rank", "slow_rank", "nan_loss", "corrupt_checkpoint")
MAX_REASON_CHARS = 500


def check_fault_request(kind: str, rank: int, factor: float) -> None:
    """What a live fault request must be before the controller sees it (it then checks it against the job
    like a ``faults:`` entry); ``ValueError`` naming the field, value and fix."""
    if kind not in LIVE_FAULT_KINDS:
        raise ValueError(f"fault kind {kind!r} cannot be injected into a running job; fix: use one of "
                         f"{', '.join(LIVE_FAULT_KINDS)} (kill_ps_shard only in the job file's faults:)")
    if rank < 0:
        raise ValueError(f"fault rank {rank} is negative; fix: pick a rank from 0 to the job's world size - 1")
    if not math.isfinite(factor) or factor <= 1:
        raise ValueError(f"fault factor {factor} is not a finite number > 1; fix: e.g. --factor 3")


def check_scale_request(dp: int) -> None:
    if dp < 1:
        raise ValueError(f"scale dp {dp} is below 1; fix: pick a data-parallel degree of at least 1")


def _invalid(context: grpc.ServicerContext, call, *args):
    """``call(*args)``, with a ``ValueError`` answered as INVALID_ARGUMENT (nothing was changed)."""
    try:
        return call(*args)
    except ValueError as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


class _Servicer(control_pb2_grpc.ControlServicer):
    def __init__(self, handler: ControlHandler, allow_faults: bool) -> None:
        self._handler = handler
        self._allow_faults = allow_faults

    def Status(self, request: control_pb2.StatusRequest, context: grpc.ServicerContext) -> control_pb2.StatusReply:
        try:
            return _reply(self._handler.status())
        except Exception as exc:  # report the controller's fault to the caller instead of a bare UNKNOWN
            context.abort(grpc.StatusCode.INTERNAL, f"controller status failed: {type(exc).__name__}: {exc}")

    def Stop(self, request: control_pb2.StopRequest, context: grpc.ServicerContext) -> control_pb2.StopReply:
        if len(request.reason) > MAX_REASON_CHARS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"stop reason is {len(request.reason)} characters; "
                          f"fix: keep it under {MAX_REASON_CHARS}")
        try:
            state = self._handler.request_stop(request.reason)
        except Exception as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"controller stop failed: {type(exc).__name__}: {exc}")
        return control_pb2.StopReply(accepted=state not in ("finished", "failed"), state=state)

    def InjectFault(self, request: control_pb2.FaultRequest, context: grpc.ServicerContext) -> control_pb2.FaultReply:
        if not self._allow_faults:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "live fault injection is off for this job; fix: set "
                          "control.allow_faults: true in the job file (default: on only when it has faults:)")
        factor = request.factor or 3.0
        _invalid(context, check_fault_request, request.kind, request.rank, factor)
        return control_pb2.FaultReply(at_step=_invalid(context, self._handler.inject_fault, request.kind,
                                                       request.rank, factor))

    def RequestScale(self, request: control_pb2.ScaleRequest, context: grpc.ServicerContext) -> control_pb2.ScaleReply:
        _invalid(context, check_scale_request, request.dp)
        return control_pb2.ScaleReply(after_step=_invalid(context, self._handler.request_scale, request.dp))


def _advertised_host(host: str) -> str:
    if host not in ("0.0.0.0", "::", "[::]", ""):
        return host
    ray = sys.modules.get("ray")  # not imported means not initialized; spares the import
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())


class ControlServer:
    """Serves ``handler`` on a background thread pool until ``close()``, to callers with ``token`` only.

    Listens on loopback unless ``host`` widens it; ``port=0`` takes a free port;
    ``address`` is what a client dials (the node IP when listening on all
    interfaces). ``tls`` is (certificate chain PEM, private key PEM): TLS only.
    ``allow_faults=False`` refuses ``InjectFault`` with PERMISSION_DENIED.
    """

    def __init__(self, handler: ControlHandler, token: str, host: str = "127.0.0.1", port: int = 0,
                 tls: tuple[bytes, bytes] | None = None, allow_faults: bool = True, token_source: str = "",
                 cert_path: str = "") -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="raymesh-control"),
                                   interceptors=[TokenInterceptor(token)])
        control_pb2_grpc.add_ControlServicer_to_server(_Servicer(handler, allow_faults), self._server)
        bound = tls_wire.add_port(self._server, f"{host}:{port}", tls)
        if bound == 0:
            raise OSError(f"control API cannot listen on {host}:{port}; fix: pick a free control.port (0: any) "
                          "and a control.host this node has")
        self._server.start()
        self.address = f"{_advertised_host(host)}:{bound}"
        self.token_source = token_source
        self.cert_path = cert_path if tls is not None else ""
        self.beyond_loopback = not (host.startswith("127.") or host in ("localhost", "::1"))

    @classmethod
    def for_job(cls, job) -> ControlServer:
        """The server a ``TrainingJob`` gets: its ``control:`` section, its token (``orchestrator/api/auth.py``)."""
        from orchestrator.api.auth import job_token

        settings = job.spec.control
        token = job_token(job.run_dir)
        tls = tls_wire.read_pair("control", settings.tls_cert, settings.tls_key)
        allow = settings.allow_faults if settings.allow_faults is not None else bool(job.spec.faults)
        return cls(job, token.value, settings.host, settings.port, tls, allow, token.source, settings.tls_cert or "")

    def announcement(self) -> dict[str, str]:
        """The fields of the ``event=control`` line: where to dial, which token, whether TLS (and its cert)."""
        out = {"address": self.address, "token": self.token_source or "-"}
        if self.cert_path:
            out["tls_cert"] = self.cert_path
        elif self.beyond_loopback:  # the user widened it (control.host), and may not know the wire is clear text
            out["warning"] = ("reachable beyond loopback without TLS: the token and requests travel in clear text; "
                              "fix: set control.tls_cert and control.tls_key")
        return out

    def close(self, grace_s: float = 1.0) -> None:
        """Stop serving; calls in flight get ``grace_s`` to finish."""
        self._server.stop(grace_s).wait()


class ControlClient:
    """Calls one controller's control API with ``token``; every call fails after ``timeout_s`` with
    ``ControlUnreachable``. ``root_cert`` (PEM) makes it speak TLS and trust that certificate."""

    def __init__(self, address: str, token: str = "", timeout_s: float = DEFAULT_TIMEOUT_S,
                 root_cert: bytes | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = call_metadata(token) if token else ()
        self._root_cert = root_cert

    @classmethod
    def from_announcement(cls, fields: dict[str, str]) -> ControlClient:
        """A client for the API a controller announced (``ControlServer.announcement``: in its log's
        ``event=control`` line, or from its hosting actor): the job's token, and TLS trusting
        ``RAYMESH_TLS_CA`` or the announced certificate."""
        root_cert = None
        if "tls_cert" in fields:
            root_cert = tls_wire.trusted_root(fields["tls_cert"], "the job's control API")
        return cls(fields["address"], client_token(fields.get("token")), root_cert=root_cert)

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
        with tls_wire.channel(self.address, self._root_cert) as channel:
            rpc = getattr(control_pb2_grpc.ControlStub(channel), method)
            try:
                return rpc(request, timeout=self.timeout_s, metadata=self._metadata)
            except grpc.RpcError as exc:
                raise _client_error(exc, self.address, method, self.timeout_s) from None


def _client_error(exc: grpc.RpcError, address: str, method: str, timeout_s: float) -> Exception:
    """The Python exception a caller of ``ControlClient`` gets for a failed call."""
    refused = tls_wire.refused_handshake(exc, "control.tls_cert", address)
    if refused is not None:
        return refused
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ControlUnreachable(
            f"cannot reach the raymesh control API at {address} ({code.name} after at most {timeout_s:g}s: "
            f"{exc.details()}); check that the job is still running (`raymesh status ID`), that {address} is the "
            "newest `event=control address=...` line in its log, and that this machine can reach that node's port "
            "(the API listens on 127.0.0.1 unless the job file sets control.host)"
        )
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(exc.details())
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return PermissionError(f"control API at {address}: {method} refused: {exc.details()}")
    return RuntimeError(f"control API at {address}: {method} failed: {exc.details()}")
