"""Parameter-server shards for the fake rank group: real ``PSShard`` objects in this process, no Ray.

``fake_ps(monkeypatch)`` patches ``ray.get``/``ray.wait``/``ray.kill``/``ray.nodes`` (so no call can start Ray)
and ``PSShards``' actor start-up, so ``TrainingJob`` with ``parallel.dp_sync: ps`` (bsp) runs on ``FakeRuntime``.
The first shards register a few chunks (the fake ranks push nothing); a restarted shard starts empty and must be
resynced. A ``kill_ps_shard`` fault makes its shard die at its next call after arming, that is during the step.
"""

from __future__ import annotations

from types import SimpleNamespace

import ray
import torch

from orchestrator.runtime.ps_shards import PSShards
from parameter_server.ring import HashRing, split
from parameter_server.shard import PSShard

LAYOUT = {"stage0.w": {"shape": [8, 4], "dtype": "float32"}}


class FakeShardHandle:
    """An actor handle: ``handle.method.remote(*args)`` returns a ref that calls ``method`` when got."""

    def __init__(self, shard: PSShard):
        self.shard, self.dead, self.dying = shard, False, False

    def __getattr__(self, method: str):
        def remote(*args):
            def ref():
                if self.dying and method != "arm_kill":
                    self.dead = True
                if self.dead:
                    raise ray.exceptions.ActorDiedError()
                if method == "arm_kill":
                    self.dying = True
                    return None
                if method == "serve_grpc":
                    return f"127.0.0.1:{5000 + self.shard.id}"
                return getattr(self.shard, method)(*args)
            return ref
        return SimpleNamespace(remote=remote)


def _get(refs, timeout=None):
    return [r() for r in refs] if isinstance(refs, list) else refs()


def _kill(handle, no_restart=True):
    handle.dead = True


def _new_shard(self: PSShards, shard: int) -> FakeShardHandle:
    """A shard as ``PSShards._new_shard`` starts it; those of the first ring hold their chunks of ``LAYOUT``."""
    real = PSShard(shard, self.ps.consistency, self.ps.server_optim(self.spec.optim), self.spec.parallel.dp,
                   [1e-3] * self.spec.train.steps)
    if not hasattr(self, "handles"):  # the job's first shards: as if the ranks registered the initial weights
        ring = HashRing(self.ps.shards, self.ps.virtual_nodes)
        chunks = split("stage0.w", torch.arange(32.0).reshape(8, 4), self.ps.chunk_elems)
        real.register({k: v for k, v in chunks.items() if shard in ring.holders(k)}, LAYOUT)
    return FakeShardHandle(real)


def fake_ps(monkeypatch) -> None:
    """Run ``PSShards`` on in-process shards (see the module docstring)."""
    monkeypatch.setattr(ray, "get", _get)
    monkeypatch.setattr(ray, "kill", _kill)
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (list(refs), []))
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}])
    monkeypatch.setattr(PSShards, "_new_shard", _new_shard)
