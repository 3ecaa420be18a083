"""Snapshots replicate in the background: a replica still in flight is never restored, only complete steps."""

from __future__ import annotations

import ray
import torch

from orchestrator.recovery.snapshot_target import newest_common_step
from tests.support.gated_holder import GatedHolder
from tests.support.jobs import wait_for
from workers.state.snapshot_store import SnapshotStore


def test_newest_common_step_skips_in_flight_and_failed_steps():
    survivor_own, replaced_replica = [4, 5, 6], [4, 5]  # step 6's replica was still shipping
    assert newest_common_step([survivor_own, survivor_own, replaced_replica], up_to=6) == 5
    assert newest_common_step([survivor_own], up_to=5) == 5  # step 6 went NaN: its snapshot is not used
    assert newest_common_step([survivor_own, [2, 3]], up_to=6) is None  # nothing in common: disk
    assert newest_common_step([], up_to=6) is None


def snap(step: int) -> dict:
    return {"model": {"w": torch.full((40_000,), float(step))}, "optim": {}, "progress": {"step": step}}


def test_replica_in_flight_is_not_restorable_until_acknowledged(ray_cluster):
    holder = ray.remote(concurrency_groups={"replicas": 1})(GatedHolder).remote(6)
    store = SnapshotStore(rank=1)
    store.holder = holder
    store.keep(5, snap(5))
    wait_for(lambda: store.replicated == 5, 60, "the replica of step 5 to be acknowledged")
    store.keep(6, snap(6))  # ships in the background; the holder holds it back
    assert ray.get(holder.held.remote(1)) == [5]
    assert store.replicated == 5
    # the sender dying now: survivors own steps 5 and 6, its replica only 5, so recovery takes step 5
    assert newest_common_step([sorted(store.own), ray.get(holder.held.remote(1))], up_to=6) == 5
    ray.get(holder.open_gate.remote())
    assert store.settle() == {"own": [5, 6], "replicas": {}}  # returns once nothing is in flight
    assert store.replicated == 6 and ray.get(holder.held.remote(1)) == [5, 6]
    assert torch.equal(ray.get(holder.replica.remote(1, 6))["model"]["w"], snap(6)["model"]["w"])
    store.keep(7, snap(7), keep_from=6)  # every rank replicated step 6: step 5 can go
    assert sorted(store.own) == [6, 7]
    store.roll_back(6)
    assert sorted(store.own) == [6] and store.replicated == 6
    ray.kill(holder)
