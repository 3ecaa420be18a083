"""Adding and removing parameter-server shards between two steps (``parameter_server.resize``).

The ring numbers its shards from 0, so growing to ``m`` shards adds the highest
ids and shrinking removes them; every other shard keeps its points, and
``parameter_server.ring.rebalance`` lists only the chunks whose primary or
replica changed (about 2/(n+1) of the chunks on adding a shard to ``n``: the new
shard's primaries and as many replicas). The move goes through the controller:
each giver's ``handover`` (values, optimizer state, and the same keys in every
step the shards kept for a rollback) is handed to its new holder's ``take``, the
old holders ``drop`` what is no longer theirs, removed shards stop, and (``PSShards.after_step``) every
rank's client is pointed at the new ring. Nothing else changes: a BSP step's
arithmetic does not depend on where a chunk lives, so the run stays on the
fixed-shard run's curve (bit-identical on CPU).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from orchestrator.events import event
from parameter_server.ring import HashRing, layout_keys, rebalance

if TYPE_CHECKING:
    from orchestrator.runtime.ps_shards import PSShards


def state_bytes(state: dict) -> int:
    """Payload bytes of a shard ``state()``: the chunks' values and their optimizer state tensors."""
    values = list(state["params"].values())
    values += [v for opt in state["opts"].values() for fields in opt["state"].values() for v in fields.values()]
    return sum(v.numel() * v.element_size() for v in values if torch.is_tensor(v))


def resize(shards: PSShards, count: int, step: int) -> dict:
    """Change ``shards`` to ``count`` shards between steps (workers quiet), moving only the affected chunks;
    returns the record of the move (also in the event log). The ranks are pointed at the new ring by the
    caller (``PSShards.after_step``), after the move is recorded: a rank lost then leaves the record whole."""
    t0 = time.perf_counter()
    before, ps = len(shards.handles), shards.ps
    keys = layout_keys(shards.layout(), ps.chunk_elems)
    plan = rebalance(shards.ring, HashRing(count, ps.virtual_nodes), keys)
    for shard in range(before, count):
        shards.add_shard(shard)
    moves = _moves(plan.copies, range(before, count))
    bundles = shards.answer([shards.handles[src].handover.remote(ks) for _, src, ks in moves],
                            "the giving shards (handing chunks over)")
    shards.answer([shards.handles[dest].take.remote(b) for (dest, _, _), b in zip(moves, bundles)],
                  "the taking shards (loading chunks)")
    shards.answer([shards.handles[s].drop.remote(ks) for s, ks in plan.drops.items()],
                  "the old holders (dropping moved chunks)")
    for shard in reversed(range(count, before)):
        shards.remove_shard(shard)
    shards.ring = HashRing(count, ps.virtual_nodes)
    record = {"at_step": step + 1, "shards_from": before, "shards_to": count, "chunks": plan.chunks,
              "primaries_moved": plan.primaries_moved, "chunks_moved": plan.chunks_copied,
              "bytes_moved": sum(state_bytes(b["now"]) for b in bundles), "seconds": time.perf_counter() - t0}
    event("ps_resized", **record)
    return record


def _moves(copies: dict[int, dict[str, int]], new: range) -> list[tuple[int, int, list[str]]]:
    """(taker, giver, keys) per pair; a new shard that takes no chunk still takes its clocks from shard 0."""
    out = []
    for dest in sorted(set(copies) | set(new)):
        by_giver: dict[int, list[str]] = {}
        for key, src in copies.get(dest, {}).items():
            by_giver.setdefault(src, []).append(key)
        out += [(dest, src, ks) for src, ks in sorted(by_giver.items())] or [(dest, 0, [])]
    return out
