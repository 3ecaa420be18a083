"""A replica holder for tests, in its own module so Ray workers can import it by name."""

from __future__ import annotations

import threading

import ray

from workers.state.snapshot_store import SnapshotStore


class GatedHolder:
    """A holder that stores the replica of ``gate_step`` only once the test opens the gate."""

    def __init__(self, gate_step: int):
        self.store = SnapshotStore(0)
        self.gate_step = gate_step
        self.gate = threading.Event()

    @ray.method(concurrency_group="replicas")
    def hold_replica(self, rank: int, step: int, snap: dict) -> None:
        if step == self.gate_step:
            self.gate.wait(60)
        self.store.hold(rank, step, snap)

    def open_gate(self) -> None:
        self.gate.set()

    def held(self, rank: int) -> list[int]:
        return sorted(self.store.replicas.get(rank, {}))

    def replica(self, rank: int, step: int) -> dict:
        return self.store.replicas[rank][step]
