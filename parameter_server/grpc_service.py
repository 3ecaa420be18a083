"""The shard's gRPC endpoint and the matching client connection.

The service forwards each RPC to the same ``PSShard`` methods the Ray actor
exposes, so both transports share one implementation of the semantics. Bad
input (unknown key, wrong shape or dtype, a worker id or clock the job does
not have) comes back as ``INVALID_ARGUMENT`` with the shard's message; a wait
that outlasts the caller's deadline as ``DEADLINE_EXCEEDED`` (the shard's
thread is free again then, so blocked callers cannot starve it); a shard that
is gone is ``UNAVAILABLE``, which the client reports as ``ShardDown`` so it
can fail over to the key's successor; a refused TLS handshake is
``CertificateRefused``, never failed over (every shard would refuse it
alike), with what the certificate must name. It listens on the node's cluster
address only, only for callers with the job's token
(``parameter_server/auth.py``), and TLS only when the job file names a
certificate (``parameter_server/tls.py``, shared with the control API).
"""

from __future__ import annotations

import json
from concurrent import futures

import grpc

from parameter_server.auth import TokenInterceptor, call_metadata
from parameter_server.errors import ShardDown
from parameter_server.proto import ps_pb2, ps_pb2_grpc
from parameter_server.tls import PemPair, add_port, channel, refused_handshake
from parameter_server.wire import to_dict, to_msg

_MAX_MSG = 512 * 1024 * 1024
_OPTIONS = [("grpc.max_send_message_length", _MAX_MSG), ("grpc.max_receive_message_length", _MAX_MSG)]


def _register_args(request) -> tuple[dict, dict]:
    """(layout, chunks) of a RegisterRequest; ``ValueError`` for a layout that is not a JSON object."""
    try:
        layout = json.loads(request.layout_json) if request.layout_json else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"layout_json is not JSON: {exc}") from None
    if not isinstance(layout, dict):
        raise ValueError("layout_json is not a JSON object of {name: {shape, dtype}}")
    return layout, to_dict(request.chunks)


class _Servicer(ps_pb2_grpc.ParameterServerServicer):
    def __init__(self, shard):
        self.shard = shard

    def _call(self, context, fn, *args):
        try:
            return fn(*args)
        except (KeyError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc.args[0] if exc.args else exc))
        except TimeoutError as exc:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))

    def Register(self, request, context):
        layout, chunks = self._call(context, _register_args, request)
        return ps_pb2.Version(version=self._call(context, self.shard.register, chunks, layout))

    def Push(self, request, context):
        grads = self._call(context, to_dict, request.grads)
        return ps_pb2.Version(version=self._call(context, self.shard.push, request.worker, request.clock, grads))

    def GradSq(self, request, context):
        return ps_pb2.GradSqReply(sq=self._call(context, self.shard.grad_sq, request.clock, list(request.keys),
                                                context.time_remaining()))

    def Apply(self, request, context):
        return ps_pb2.Version(version=self._call(context, self.shard.apply, request.clock, request.coef,
                                                 context.time_remaining()))

    def Pull(self, request, context):
        out = self._call(context, self.shard.pull, list(request.keys), request.min_version, request.worker,
                         request.clock, request.wire_dtype, context.time_remaining())
        return ps_pb2.PullReply(version=out["version"], chunks=[to_msg(k, v) for k, v in out["chunks"].items()],
                                min_applied=out["min_applied"])

    def Clock(self, request, context):
        c = self.shard.clock()
        return ps_pb2.ClockReply(shard=c["shard"], version=c["version"], applied_from=c["applied_from"],
                                 keys=c["keys"], layout_json=json.dumps(c["layout"]))


class GrpcEndpoint:
    def __init__(self, server: grpc.Server, address: str):
        self.server = server
        self.address = address


def serve(shard, ip: str, token: str, tls: PemPair | None = None) -> GrpcEndpoint:
    """Serve ``shard`` to callers with ``token`` on a free port of ``ip`` (the node's cluster address); TLS only
    with ``tls`` (certificate chain PEM, key PEM)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=_OPTIONS,
                         interceptors=[TokenInterceptor(token)])
    ps_pb2_grpc.add_ParameterServerServicer_to_server(_Servicer(shard), server)
    port = add_port(server, f"{ip}:0", tls)
    if port == 0:
        raise OSError(f"parameter-server shard cannot listen on {ip}; fix: check that Ray's node IP is this "
                      "node's address (`ray start --node-ip-address`)")
    server.start()
    return GrpcEndpoint(server, f"{ip}:{port}")


def _raise_if_refused(exc: grpc.RpcError, address: str) -> None:
    """``CertificateRefused`` naming what to fix when ``exc`` is a refused TLS handshake with ``address``."""
    refused = refused_handshake(exc, "parameter_server.tls_cert", address)
    if refused is not None:
        raise refused from None


class _GrpcFuture:
    def __init__(self, future, convert, address: str):
        self.future, self.convert, self.address = future, convert, address

    def result(self):
        try:
            return self.convert(self.future.result())
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(exc.details()) from None
            _raise_if_refused(exc, self.address)
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise ShardDown(exc.details()) from None
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise PermissionError(exc.details()) from None
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(exc.details()) from None
            raise


class GrpcConn:
    """A client's connection to one shard over gRPC (no Ray needed: usable from any process), with ``token``;
    TLS trusting ``root_cert`` (PEM) when the shards speak TLS (a plaintext call to them fails as ``ShardDown``, a
    certificate that does not name ``address`` as ``CertificateRefused``)."""

    def __init__(self, address: str, token: str, root_cert: bytes | None = None):
        self.address = address
        self.channel = channel(address, root_cert, _OPTIONS)
        self.stub = ps_pb2_grpc.ParameterServerStub(self.channel)
        self.metadata = call_metadata(token)

    def close(self) -> None:
        """Cancel this connection's calls still in flight and release its channel: a process that exits with a
        call pending on an open channel can wait on gRPC's threads for good."""
        self.channel.close()

    def _future(self, rpc, request, convert):
        return _GrpcFuture(rpc.future(request, metadata=self.metadata), convert, self.address)

    def register(self, chunks, layout):
        req = ps_pb2.RegisterRequest(chunks=[to_msg(k, v) for k, v in chunks.items()], layout_json=json.dumps(layout))
        return self._future(self.stub.Register, req, lambda r: r.version)

    def push(self, worker, clock, grads):
        req = ps_pb2.PushRequest(worker=worker, clock=clock, grads=[to_msg(k, v) for k, v in grads.items()])
        return self._future(self.stub.Push, req, lambda r: r.version)

    def grad_sq(self, clock, keys):
        return self._future(self.stub.GradSq, ps_pb2.GradSqRequest(clock=clock, keys=keys), lambda r: dict(r.sq))

    def apply(self, clock, coef):
        return self._future(self.stub.Apply, ps_pb2.ApplyRequest(clock=clock, coef=coef), lambda r: r.version)

    def pull(self, keys, min_version=0, worker=-1, clock=-1, wire_dtype=""):
        req = ps_pb2.PullRequest(keys=keys, min_version=min_version, worker=worker, clock=clock, wire_dtype=wire_dtype)
        return self._future(self.stub.Pull, req, lambda r: {"version": r.version, "chunks": to_dict(r.chunks),
                                                                  "min_applied": r.min_applied})

    def clock(self):
        def convert(r):
            return {"shard": r.shard, "version": r.version, "applied_from": list(r.applied_from), "keys": r.keys,
                    "layout": json.loads(r.layout_json or "{}")}
        return self._future(self.stub.Clock, ps_pb2.ClockRequest(), convert)


def check_handshake(address: str, token: str, root_cert: bytes, timeout_s: float = 10.0) -> None:
    """Dial ``address`` as a rank will, trusting ``root_cert``: ``CertificateRefused`` when the TLS handshake is
    refused. Anything else (this process cannot reach that node, the call is slow) is left to the ranks."""
    conn = GrpcConn(address, token, root_cert)
    try:
        conn.stub.Clock(ps_pb2.ClockRequest(), metadata=conn.metadata, timeout=timeout_s)
    except grpc.RpcError as exc:
        _raise_if_refused(exc, address)
    finally:
        conn.close()
