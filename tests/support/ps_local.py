"""Parameter-server shards called in the test's own process (no Ray, no gRPC): ``PSClient(conns=[LocalConn(s)])``."""

from __future__ import annotations

from parameter_server.shard import PSShard


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class LocalConn:
    """A shard called in this process (the calls of one BSP step never wait: every push comes first)."""

    def __init__(self, shard: PSShard):
        self.shard = shard

    def __getattr__(self, method):
        return lambda *args: _Done(getattr(self.shard, method)(*args))
