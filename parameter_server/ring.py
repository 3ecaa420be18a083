"""Which shard holds which piece of which tensor: a consistent-hash ring with virtual nodes.

Written here because no library we use has one. Each shard owns ``vnodes``
points on a 64-bit ring; a chunk key belongs to the first point clockwise from
its hash (its primary) and is replicated on the next *distinct* shard after
that (its successor), as in Dynamo-style preference lists. Large tensors are
cut into flat chunks of at most ``chunk_elems`` elements first, so one big
embedding does not land whole on one shard. The layout depends only on the
shard count and these two numbers, so every worker, the controller and an
outside gRPC reader compute the same placement without asking anyone.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass

import torch


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def chunk_key(name: str, index: int) -> str:
    return f"{name}#{index}"


def chunk_count(numel: int, chunk_elems: int) -> int:
    return max(1, math.ceil(numel / chunk_elems))


def chunk_keys(name: str, shape, chunk_elems: int) -> list[str]:
    """Every chunk key of tensor ``name`` of ``shape``, in order."""
    return [chunk_key(name, i) for i in range(chunk_count(math.prod(shape), chunk_elems))]


def layout_keys(layout: dict[str, dict], chunk_elems: int) -> list[str]:
    """Every chunk key of a registered layout (tensor name -> ``{"shape": ...}``), tensors in name order."""
    return [key for name in sorted(layout) for key in chunk_keys(name, layout[name]["shape"], chunk_elems)]


def split(name: str, tensor: torch.Tensor, chunk_elems: int) -> dict[str, torch.Tensor]:
    """``tensor`` as flat contiguous chunks keyed ``name#i``."""
    flat = tensor.detach().reshape(-1)
    return {chunk_key(name, i): c.contiguous() for i, c in enumerate(flat.split(chunk_elems))}


def assemble(name: str, chunks: dict[str, torch.Tensor], shape: torch.Size | tuple, chunk_elems: int) -> torch.Tensor:
    """The inverse of ``split``."""
    return torch.cat([chunks[key] for key in chunk_keys(name, shape, chunk_elems)]).reshape(shape)


@dataclass(frozen=True)
class HashRing:
    shards: int
    vnodes: int = 64

    def __post_init__(self) -> None:
        points = sorted((_hash(f"shard{s}/vnode{v}"), s) for s in range(self.shards) for v in range(self.vnodes))
        object.__setattr__(self, "_points", [p for p, _ in points])
        object.__setattr__(self, "_owners", [s for _, s in points])

    def holders(self, key: str) -> list[int]:
        """``[primary, successor]`` for ``key`` (just ``[primary]`` on a one-shard ring)."""
        i = bisect.bisect(self._points, _hash(key)) % len(self._points)
        out = [self._owners[i]]
        for j in range(1, len(self._owners)):
            owner = self._owners[(i + j) % len(self._owners)]
            if owner != out[0]:
                out.append(owner)
                break
        return out

    def primary(self, key: str) -> int:
        return self.holders(key)[0]


@dataclass(frozen=True)
class Rebalance:
    """What changing the shard count does to each chunk: the copies to make and the keys each shard drops.

    ``copies[dest][key]`` is the old holder ``dest`` takes ``key`` from; ``drops[shard]`` the keys ``shard`` held
    and holds no more. A chunk whose holders stay the same is in neither: adding shard ``n`` to a ring of ``n``
    copies only what the new shard now holds (its primary share, about 1/(n+1) of the chunks, and as many
    replicas), and removing the highest shard copies only what it held.
    """

    copies: dict[int, dict[str, int]]
    drops: dict[int, list[str]]
    primaries_moved: int  # chunks whose primary changed
    chunks: int  # chunks in all

    @property
    def chunks_copied(self) -> int:
        return sum(len(keys) for keys in self.copies.values())


def rebalance(old: HashRing, new: HashRing, keys: list[str]) -> Rebalance:
    """The moves from ``old`` to ``new`` for ``keys`` (both rings number their shards from 0, so growing adds the
    highest ids and shrinking removes them, and every other shard keeps its points: consistent hashing)."""
    copies: dict[int, dict[str, int]] = {}
    drops: dict[int, list[str]] = {}
    moved = 0
    for key in keys:
        before, after = old.holders(key), new.holders(key)
        moved += before[0] != after[0]
        for dest in after:
            if dest not in before:
                copies.setdefault(dest, {})[key] = before[0]
        for shard in before:
            if shard not in after and shard < new.shards:
                drops.setdefault(shard, []).append(key)
    return Rebalance(copies, drops, moved, len(keys))
