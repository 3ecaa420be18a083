"""The shard's gRPC endpoint and the matching client connection.

The service forwards each RPC to the same ``PSShard`` methods the Ray actor
exposes, so both transports share one implementation of the semantics. Bad
input (unknown key, wrong shape or dtype) comes back as ``INVALID_ARGUMENT``
with the shard's message; a shard that is gone is ``UNAVAILABLE``, which the
client reports as ``ShardDown`` so it can fail over to the key's successor.
"""

from __future__ import annotations

import json
from concurrent import futures

import grpc

from parameter_server.errors import ShardDown
from parameter_server.proto import ps_pb2, ps_pb2_grpc
from parameter_server.wire import from_msg, to_dict, to_msg

_MAX_MSG = 512 * 1024 * 1024
_OPTIONS = [("grpc.max_send_message_length", _MAX_MSG), ("grpc.max_receive_message_length", _MAX_MSG)]


class _Servicer(ps_pb2_grpc.ParameterServerServicer):
    def __init__(self, shard):
        self.shard = shard

    def _call(self, context, fn, *args):
        try:
            return fn(*args)
        except (KeyError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc.args[0] if exc.args else exc))

    def Register(self, request, context):
        layout = json.loads(request.layout_json) if request.layout_json else {}
        return ps_pb2.Version(version=self._call(context, self.shard.register, to_dict(request.chunks), layout))

    def Push(self, request, context):
        grads = {m.key: from_msg(m) for m in request.grads}
        return ps_pb2.Version(version=self._call(context, self.shard.push, request.worker, request.clock, grads,
                                                 request.lr))

    def GradSq(self, request, context):
        return ps_pb2.GradSqReply(sq=self._call(context, self.shard.grad_sq, request.clock, list(request.keys)))

    def Apply(self, request, context):
        return ps_pb2.Version(version=self._call(context, self.shard.apply, request.clock, request.coef))

    def Pull(self, request, context):
        out = self._call(context, self.shard.pull, list(request.keys), request.min_version, request.worker,
                         request.clock)
        return ps_pb2.PullReply(version=out["version"], chunks=[to_msg(k, v) for k, v in out["chunks"].items()])

    def Clock(self, request, context):
        c = self.shard.clock()
        return ps_pb2.ClockReply(shard=c["shard"], version=c["version"], applied_from=c["applied_from"],
                                 keys=c["keys"], layout_json=json.dumps(c["layout"]))


class GrpcEndpoint:
    def __init__(self, server: grpc.Server, address: str):
        self.server = server
        self.address = address


def serve(shard, advertise_ip: str) -> GrpcEndpoint:
    """Serve ``shard`` on a free port of every interface; the address others use is ``advertise_ip:port``."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=_OPTIONS)
    ps_pb2_grpc.add_ParameterServerServicer_to_server(_Servicer(shard), server)
    port = server.add_insecure_port("0.0.0.0:0")
    server.start()
    return GrpcEndpoint(server, f"{advertise_ip}:{port}")


class _GrpcFuture:
    def __init__(self, future, convert):
        self.future, self.convert = future, convert

    def result(self):
        try:
            return self.convert(self.future.result())
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(exc.details()) from None
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise ShardDown(exc.details()) from None
            raise


class GrpcConn:
    """A client's connection to one shard over gRPC (no Ray needed: usable from any process)."""

    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.insecure_channel(address, options=_OPTIONS)
        self.stub = ps_pb2_grpc.ParameterServerStub(self.channel)

    def register(self, chunks, layout):
        req = ps_pb2.RegisterRequest(chunks=[to_msg(k, v) for k, v in chunks.items()], layout_json=json.dumps(layout))
        return _GrpcFuture(self.stub.Register.future(req), lambda r: r.version)

    def push(self, worker, clock, grads, lr):
        req = ps_pb2.PushRequest(worker=worker, clock=clock, lr=lr, grads=[to_msg(k, v) for k, v in grads.items()])
        return _GrpcFuture(self.stub.Push.future(req), lambda r: r.version)

    def grad_sq(self, clock, keys):
        return _GrpcFuture(self.stub.GradSq.future(ps_pb2.GradSqRequest(clock=clock, keys=keys)), lambda r: dict(r.sq))

    def apply(self, clock, coef):
        return _GrpcFuture(self.stub.Apply.future(ps_pb2.ApplyRequest(clock=clock, coef=coef)), lambda r: r.version)

    def pull(self, keys, min_version=0, worker=-1, clock=-1):
        req = ps_pb2.PullRequest(keys=keys, min_version=min_version, worker=worker, clock=clock)
        return _GrpcFuture(self.stub.Pull.future(req),
                           lambda r: {"version": r.version, "chunks": to_dict(r.chunks)})

    def clock(self):
        def convert(r):
            return {"shard": r.shard, "version": r.version, "applied_from": list(r.applied_from), "keys": r.keys,
                    "layout": json.loads(r.layout_json or "{}")}
        return _GrpcFuture(self.stub.Clock.future(ps_pb2.ClockRequest()), convert)
