"""The exchange after each step: partial summaries up a tree to the root, the root's decision back down.

Why a tree and not a gather: rank 0 receives from at most ``fan_in`` children and each rank sends one message
up and one down, so neither the root's work nor any rank's grows with the world; the latency is
``2 log_fan_in(world)`` hops (about ten at 16,384 ranks with a fan-in of 8). Participants are numbered from 0
(the root); a participant is one rank, or one host of virtual ranks in the simulator. Written here because
``torch.distributed`` has no reduction of Python objects with a user merge: its ``gather_object`` lands every
rank's object on one rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

FAN_IN = 8  # the ranks of one 8-GPU node are one parent's children (tensor parallelism is innermost)


class Transport(Protocol):
    """Point-to-point messages between participants of one exchange (gloo for ranks, Ray for virtual hosts)."""

    def send(self, obj: Any, to: int) -> None: ...
    def recv(self, source: int) -> Any: ...


def parent(me: int, fan_in: int = FAN_IN) -> int | None:
    return None if me == 0 else (me - 1) // fan_in


def children(me: int, size: int, fan_in: int = FAN_IN) -> range:
    first = me * fan_in + 1
    return range(min(first, size), min(first + fan_in, size))


class TreeExchange:
    """One participant's side of every exchange of its group."""

    def __init__(self, me: int, size: int, transport: Transport, fan_in: int = FAN_IN):
        self.me, self.size, self.transport = me, size, transport
        self.parent = parent(me, fan_in)
        self.children = children(me, size, fan_in)

    @property
    def root(self) -> bool:
        return self.parent is None

    def exchange(self, partial: Any, decide: Callable[[Any], Any]) -> Any:
        """Merge ``partial`` with the children's (``partial.merge``), hand the whole to the root's ``decide`` and
        return what it decided, the same on every participant."""
        for child in self.children:
            partial = partial.merge(self.transport.recv(child))
        if self.parent is None:
            decision = decide(partial)
        else:
            self.transport.send(partial, self.parent)
            decision = self.transport.recv(self.parent)
        for child in self.children:
            self.transport.send(decision, child)
        return decision


class LocalTransport:
    """A group of one participant: nothing to send (a one-rank job; every fake group)."""

    def send(self, obj: Any, to: int) -> None:
        raise RuntimeError(f"a one-participant exchange has no participant {to}")

    def recv(self, source: int) -> Any:
        raise RuntimeError(f"a one-participant exchange has no participant {source}")
