"""One rank's Trainer run outside Ray, printing its peak memory and step times as JSON.

Peak resident memory is a per-process figure (``VmHWM``); an actor's
process also carries Ray's own buffers and whatever earlier tasks left, so
memory comparisons (tests, ``benchmarks/memory.py``) run each configuration in
fresh processes started by this module — alone (world size 1, the default) or
under ``torchrun`` (which sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    python -m workers.peak_memory_run SPEC.json STEPS
"""

from __future__ import annotations

import json
import os
import socket
import sys

from workers.parallel.process_group import listen_on
from workers.trainer import Trainer


def _rendezvous() -> tuple[str, int, socket.socket | None]:
    """torchrun's MASTER_ADDR/MASTER_PORT; alone, a loopback port this process binds now and hands to its store
    (a port picked and released here could be taken before the store binds it)."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if os.environ.get("MASTER_PORT"):
        return addr, int(os.environ["MASTER_PORT"]), None
    listener = listen_on(addr)
    return addr, listener.getsockname()[1], listener


def probe(spec: dict, steps: int) -> dict:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    addr, port, listener = _rendezvous()
    trainer = Trainer(spec, rank, world, addr, port, listener=listener)
    results = [trainer.train_step() for _ in range(steps)]
    stores = [o.store for o in trainer.state.optimizers if hasattr(o, "store")]
    if trainer.param_offload is not None:
        stores.append(trainer.param_offload.store)
    return {
        "rank": rank,
        "losses": [r.loss for r in results],
        "step_s": [r.time_s.step for r in results],
        "peak_memory_bytes": trainer.peak_memory_bytes(),
        "offloaded_bytes": sum(s.nbytes for s in stores) + trainer.activations.peak_bytes,
    }


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    print(json.dumps(probe(spec, int(sys.argv[2]))), flush=True)
