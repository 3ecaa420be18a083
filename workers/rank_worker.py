"""``RankWorker``: the Ray actor that hosts one rank's ``Trainer``.

The class is plain Python; the orchestrator turns it into an actor with
``ray.remote`` and its placement options, so this package never depends on the
controller.
"""

from __future__ import annotations

import contextlib
import os
import socket

import ray


class RankWorker:
    def __init__(self) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.trainer = None
        self.snapshot: dict | None = None  # this rank's latest in-memory snapshot
        self.replicas: dict[int, dict] = {}  # other ranks' snapshots this actor keeps a copy of

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a free port, for rank 0 to host the process-group store."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def identity(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "actor_id": ctx.get_actor_id()}

    def preload(self) -> None:
        """Import torch and the trainer before the rendezvous: a fresh process takes seconds to import on a
        loaded host, and its peers would spend them waiting in the store, against the collective timeout."""
        import workers.trainer  # noqa: F401

    def setup(self, spec: dict, rank: int, world_size: int, master_addr: str, master_port: int) -> dict:
        """Join the process group and build this rank's model; after a peer failed, do it again in place.

        A survivor keeps its process (Python and its imports): only the broken process group
        and the objects bound to it are rebuilt. Returns the rank's place, device and identity.
        """
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        from workers.trainer import Trainer

        if dist.is_initialized():
            self.trainer = None
            dist.destroy_process_group()
        self.trainer = Trainer(spec, rank, world_size, master_addr, master_port)
        t = self.trainer
        name = torch.cuda.get_device_name(t.device) if t.device.type == "cuda" else "cpu"
        return {"rank": rank, "coords": vars(t.coords), "stages": t.parts.stage_ids, "device": str(t.device),
                "device_name": name, **self.identity()}

    def train_step(self, fault: dict | None = None) -> dict:
        return self.trainer.train_step(fault)

    def ps_reroute(self, shard: int, route: dict) -> None:
        """A parameter-server shard was restarted and resynced: send its keys there again."""
        self.trainer.ps.reroute(shard, route)

    def take_snapshot(self) -> dict:
        from workers import snapshot

        self.snapshot = snapshot.take(self.trainer)
        return self.snapshot

    def kept_snapshot(self) -> dict | None:
        """This rank's last snapshot, for the rank of a smaller grid that takes over its position."""
        return self.snapshot

    def hold_replica(self, rank: int, snap: dict) -> None:
        self.replicas[rank] = snap

    def replica(self, rank: int) -> dict | None:
        return self.replicas.get(rank)

    def restore_snapshot(self, snap: dict | None = None) -> int:
        """Roll back to ``snap`` (a replica handed over for a replaced rank) or to this rank's own."""
        from workers import snapshot

        self.snapshot = snap if snap is not None else self.snapshot
        snapshot.restore(self.trainer, self.snapshot)
        return self.trainer.step

    def save_checkpoint(self, path: str, async_save: bool) -> None:
        ps = self.trainer.ps  # asp/ssp train on their own thread: save between two of its steps
        with ps.quiet if ps is not None else contextlib.nullcontext():
            self.trainer.checkpoints.save(path, async_save)

    def wait_checkpoint(self) -> int | None:
        return self.trainer.checkpoints.wait()

    def load_checkpoint(self, path: str) -> int:
        self.trainer.checkpoints.load(path)
        return self.trainer.step

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.trainer is not None:
            self.trainer.checkpoints.wait()
            self.trainer.close_stores()
        if dist.is_initialized():
            dist.destroy_process_group()
