"""Spawned gloo ranks that roll back to an in-memory snapshot and replay: the steps after the rollback must be the
ones they first trained, bit for bit (``spawn_ranks``' body, for jobs whose ranks each keep state of their own)."""

from __future__ import annotations

import torch


def replay_from_snapshot(rank: int, spec: dict, ports, world_size: int, before: int, after: int, results) -> None:
    """Train ``before`` steps, take a snapshot, train ``after`` more, restore it and train them again; put
    ``(rank, (first losses, replayed losses))``."""
    import torch.distributed as dist

    from workers.state import snapshot
    from workers.trainer import Trainer

    torch.set_num_threads(1)
    port, listener = ports.join(rank, 0)
    trainer = Trainer(spec, rank, world_size, "127.0.0.1", port, listener=listener)
    for _ in range(before):
        trainer.train_step()
    snap = snapshot.take(trainer.state)
    first = [trainer.train_step().loss for _ in range(after)]
    snapshot.restore(trainer.state, snap)
    again = [trainer.train_step().loss for _ in range(after)]
    dist.destroy_process_group()
    results.put((rank, (first, again)))
