"""``PSClient``: what a worker (or any reader) uses to push gradients to and pull parameters from the shards.

It cuts each named tensor into chunks, finds each chunk's holders on the ring
(primary and successor), and talks to the shards through a connection per
shard (Ray actor handle or gRPC channel; both return futures with
``result()``). Pushes and registrations go to every live holder, so an
acknowledged push is on two shards; reads go to the first live holder. A
shard that is gone is marked down and its keys are served by their successor
until the controller restarts it and calls ``reroute``.

With ``codec`` (``parameter_server.compression``) pushes go out compressed and pulls come in bf16 when asked;
``traffic`` counts the payload bytes of every push and pull message, and the staleness of asp/ssp reads, since
the last ``take_traffic``.
"""

from __future__ import annotations

import time

import torch

from parameter_server.compression import nbytes
from parameter_server.errors import ShardDown
from parameter_server.ring import HashRing, assemble, chunk_keys, split

UNAVAILABLE_RETRY_S = (0.5, 1.0, 2.0)  # waits before each new try of a call to a shard Ray says is unavailable


class RayConn:
    """A connection to a shard actor over Ray actor calls."""

    def __init__(self, handle):
        self.handle = handle

    def __getattr__(self, method):
        remote = getattr(self.handle, method).remote
        return lambda *args: _RayFuture(lambda: remote(*args))


class _RayFuture:
    """A shard call's result. Ray's ``ActorUnavailableError`` says the actor may answer again and the call may
    or may not have run (a dropped connection: seen on a live shard when a rank on the node was SIGKILLed), so
    the call is made again; every shard call is idempotent (a push for a clock the shard applied from that
    worker is acknowledged, not applied twice). Only a shard Ray declares dead, or one still unavailable after
    the retries, is ``ShardDown``: marking a live shard down loses it for the rest of the worker's life."""

    def __init__(self, submit):
        self.submit = submit
        self.ref = submit()

    def result(self):
        import ray

        for wait_s in (*UNAVAILABLE_RETRY_S, None):
            try:
                return ray.get(self.ref)
            except ray.exceptions.ActorUnavailableError as exc:
                if wait_s is None:
                    raise ShardDown(str(exc)) from None
                time.sleep(wait_s)
                self.ref = self.submit()
            except ray.exceptions.RayActorError as exc:
                raise ShardDown(str(exc)) from None
            except ray.exceptions.RayTaskError as exc:
                raise exc.as_instanceof_cause() from None


class _Plain:
    """No compression: pushes as given, pulls in the held dtype."""

    pull_dtype = ""

    @staticmethod
    def encode(chunks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return chunks


def _dtype(layout: dict) -> torch.dtype:
    """The registered dtype of a tensor (a bf16 pull is cast back to it)."""
    return getattr(torch, layout["dtype"])


def new_traffic() -> dict[str, int]:
    return {"push": 0, "pull": 0, "staleness": 0}


class PSClient:
    def __init__(self, conns: list, chunk_elems: int, vnodes: int, worker: int = -1, codec=None):
        """``codec``: ``encode(chunks)`` for each push and ``pull_dtype`` for pulls (a worker's
        ``grad_compression.WireCodec``); None sends tensors as they are."""
        self.conns = list(conns)
        self.codec = codec or _Plain()
        self.traffic = new_traffic()
        self.ring = HashRing(len(conns), vnodes)
        self.chunk_elems = chunk_elems
        self.worker = worker
        self.alive = [True] * len(conns)
        self.layout: dict[str, dict] = {}

    # -- placement --------------------------------------------------------------------------

    def _holders(self, key: str) -> list[int]:
        live = [s for s in self.ring.holders(key) if self.alive[s]]
        if not live:
            raise ShardDown(f"every holder of {key!r} ({self.ring.holders(key)}) is down")
        return live

    def keys_of(self, name: str) -> list[str]:
        return chunk_keys(name, self.layout[name]["shape"], self.chunk_elems)

    def reroute(self, shard: int, conn) -> None:
        """The controller restarted ``shard`` (resynced): use it again."""
        self.conns[shard] = conn
        self.alive[shard] = True

    def reshard(self, conns: list) -> None:
        """The controller changed the shard count (and moved the chunks): place keys on the new ring from now on."""
        self.conns = list(conns)
        self.ring = HashRing(len(conns), self.ring.vnodes)
        self.alive = [True] * len(conns)

    # -- fan-out with failover -------------------------------------------------------------------

    def _send(self, per_shard: dict[int, tuple]) -> dict[int, object]:
        """Call ``method(*args)`` on each shard at once; a shard that is gone is marked down and left out."""
        pending = {s: getattr(self.conns[s], method)(*args) for s, (method, *args) in per_shard.items()}
        out = {}
        for s, fut in pending.items():
            try:
                out[s] = fut.result()
            except ShardDown:
                self.alive[s] = False
        return out

    def _to_all_holders(self, chunks: dict[str, torch.Tensor], call) -> None:
        """Send each chunk to every live holder (``call(part)`` -> (method, *args)); done once each chunk is
        acknowledged by a holder that is still alive."""
        todo = dict(chunks)
        while todo:
            per_shard: dict[int, dict] = {}
            for key, value in todo.items():
                for s in self._holders(key):
                    per_shard.setdefault(s, {})[key] = value
            done = self._send({s: call(part) for s, part in per_shard.items()})
            todo = {k: v for k, v in todo.items() if not any(s in done for s in self.ring.holders(k))}

    def _from_first_holder(self, keys: list[str], call, unpack=lambda reply: reply) -> dict[str, object]:
        """Ask each key's first live holder (``call(keys)`` -> (method, *args)); fail over when one is gone."""
        out: dict[str, object] = {}
        todo = list(keys)
        while todo:
            per_shard: dict[int, list[str]] = {}
            for key in todo:
                per_shard.setdefault(self._holders(key)[0], []).append(key)
            for reply in self._send({s: call(ks) for s, ks in per_shard.items()}).values():
                out.update(unpack(reply))
            todo = [k for k in todo if k not in out]
        return out

    # -- the API a worker uses -----------------------------------------------------------------

    def register(self, named: dict[str, torch.Tensor]) -> None:
        """Give the shards the initial values (first registration wins) and remember the layout."""
        layout = {n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for n, t in named.items()}
        self.layout.update(layout)
        chunks = {k: v for n, t in named.items() for k, v in split(n, t, self.chunk_elems).items()}
        self._to_all_holders(chunks, lambda part: ("register", part, layout))

    def push(self, clock: int, grads: dict[str, torch.Tensor]) -> None:
        """Push this worker's gradients for ``clock``; returns once every chunk is acknowledged (the shards
        step at the job's own learning rate).

        Checked whole against the registered layout first, so a bad push reaches no shard; each shard
        checks its chunks again (an outside gRPC client has no layout).
        """
        for name, g in grads.items():
            want = self.layout.get(name)
            if want is None:
                raise KeyError(f"push of unknown key {name!r} (shape {tuple(g.shape)}); nothing applied. "
                               f"Registered keys look like {sorted(self.layout)[:3]}")
            dtype = str(g.dtype).removeprefix("torch.")
            if list(g.shape) != want["shape"] or dtype != want["dtype"]:
                raise ValueError(f"push of key {name!r} has shape {tuple(g.shape)} dtype {dtype}, expected shape "
                                 f"{tuple(want['shape'])} dtype {want['dtype']}; nothing applied")
        chunks = self.codec.encode({k: v for n, g in grads.items() for k, v in split(n, g, self.chunk_elems).items()})
        self._to_all_holders(chunks, lambda part: ("push", self.worker, clock, self._counted("push", part)))
        used = {s for k in chunks for s in self.ring.holders(k)}  # an empty push to the rest advances this
        idle = [s for s in range(len(self.conns)) if self.alive[s] and s not in used]  # worker's clock there
        self._send({s: ("push", self.worker, clock, {}) for s in idle})

    def grad_sq(self, clock: int, names: list[str]) -> float:
        """bsp: squared L2 norm of the averaged gradient of ``names`` for ``clock`` (each key counted once,
        summed in a fixed order so every worker gets the same number)."""
        keys = [k for n in names for k in self.keys_of(n)]
        sq = self._from_first_holder(keys, lambda ks: ("grad_sq", clock, ks))
        return sum(sq[k] for k in keys)

    def apply(self, clock: int, coef: float) -> None:
        """bsp: have every live shard step its keys for ``clock`` (idempotent: the first caller applies)."""
        self._send({s: ("apply", clock, coef) for s in range(len(self.conns)) if self.alive[s]})

    def skip(self, clock: int) -> None:
        """bsp: every worker skips ``clock`` (an fp16 overflow all agreed on): the shards pass it without a step."""
        self._send({s: ("apply", clock, 0.0) for s in range(len(self.conns)) if self.alive[s]})

    def pull(self, names: list[str], min_version: int = 0, clock: int = -1) -> dict[str, torch.Tensor]:
        """Whole tensors by name, once their shards reach ``min_version``."""
        keys = [k for n in names for k in self.keys_of(n)]
        chunks = self._from_first_holder(keys, lambda ks: ("pull", ks, min_version, self.worker, clock,
                                                           self.codec.pull_dtype),
                                         lambda reply: self._read(reply, clock))
        return {n: assemble(n, chunks, self.layout[n]["shape"], self.chunk_elems).to(_dtype(self.layout[n]))
                for n in names}

    def _counted(self, direction: str, chunks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``chunks``, after adding their payload bytes to ``traffic[direction]`` (``push`` or ``pull``)."""
        self.traffic[direction] += sum(nbytes(c) for c in chunks.values())
        return chunks

    def _read(self, reply: dict, clock: int) -> dict[str, torch.Tensor]:
        """A pull reply's chunks, counted; an asp/ssp training read also records how many steps the reader's clock
        is ahead of the fewest pushes the shard applied from its stage (the SSP bound's quantity)."""
        applied = reply.get("min_applied", -1)
        if clock >= 0 and applied >= 0:
            self.traffic["staleness"] = max(self.traffic["staleness"], clock - applied)
        return self._counted("pull", reply["chunks"])

    def take_traffic(self) -> dict[str, int]:
        """Push and pull payload bytes and the largest read staleness since the last call (a step's ``ps``)."""
        out, self.traffic = self.traffic, new_traffic()
        return out

    def take_wire_bytes(self) -> int:
        """Push plus pull payload bytes since the last call (and the rest of ``take_traffic`` dropped)."""
        out = self.take_traffic()
        return out["push"] + out["pull"]

    def clocks(self) -> list[dict]:
        return list(self._send({s: ("clock",) for s in range(len(self.conns)) if self.alive[s]}).values())
