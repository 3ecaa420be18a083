"""Elastic parameter-server shards, no Ray: which chunks move when the shard count changes (only the added or
removed shard's, about 1/(n+1) of the chunks plus their replicas), and shards that hand chunks over mid-run
(with their optimizer state and kept steps) train on, and roll back, bit-identically to shards that never moved."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from orchestrator.errors import SpecError
from orchestrator.runtime.ps_resize import _moves
from orchestrator.spec import JobSpec
from parameter_server.client import PSClient
from parameter_server.clocks import ClockKeeper
from parameter_server.ring import HashRing, rebalance
from parameter_server.shard import PSShard
from tests.support.ps_local import LocalConn

KEYS = [f"stage0.w{i}#{j}" for i in range(40) for j in range(50)]  # 2,000 chunks
VNODES = 64
SPREAD = 1 + 2 / math.sqrt(VNODES)  # two sigma of a shard's share of a ring with VNODES points per shard
ADAMW = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.95], "momentum": 0.0}
LRS = [0.1, 0.05, 0.02, 0.01, 0.01]
WORKERS = 2
CLIP = 0.5


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_adding_a_shard_moves_only_what_the_new_shard_holds(n):
    old, new = HashRing(n, VNODES), HashRing(n + 1, VNODES)
    plan = rebalance(old, new, KEYS)
    held_by_new = {k for k in KEYS if n in new.holders(k)}
    assert set(plan.copies) == {n} and set(plan.copies[n]) == held_by_new  # every copy goes to the new shard
    assert plan.primaries_moved == sum(new.primary(k) == n for k in KEYS)  # no primary moves between old shards
    for key in set(KEYS) - held_by_new:
        assert old.holders(key) == new.holders(key)
    assert all(n not in old.holders(k) for k in KEYS)
    # about 1/(n+1) of the chunks change primary, and the new shard's replicas as many again (1/(n+1) of the
    # 2 x chunks copies held); on one concrete ring within two sigma of that
    assert plan.primaries_moved / len(KEYS) <= SPREAD / (n + 1)
    assert plan.chunks_copied / (2 * len(KEYS)) <= SPREAD / (n + 1)
    assert sum(len(ks) for ks in plan.drops.values()) == plan.chunks_copied - (n == 1) * len(KEYS)


def test_the_jobs_layout_moves_at_most_a_third_of_the_primaries_from_2_to_3_shards():
    plan = rebalance(HashRing(2), HashRing(3), KEYS)
    assert plan.primaries_moved / len(KEYS) <= 1 / 3  # 0.3195 on this ring
    assert plan.chunks_copied / (2 * len(KEYS)) <= SPREAD / 3  # 0.350: the replicas vary more


@pytest.mark.parametrize("n", [2, 3, 5])
def test_removing_the_highest_shard_is_the_inverse(n):
    """Its chunks go to the shards that now hold them; nothing else moves and no remaining shard drops a key."""
    old, new = HashRing(n + 1, VNODES), HashRing(n, VNODES)
    plan = rebalance(old, new, KEYS)
    grown = rebalance(new, old, KEYS)
    assert sorted(k for ks in plan.copies.values() for k in ks) == sorted(grown.copies[n])
    assert plan.drops == {} and plan.primaries_moved == grown.primaries_moved
    for dest, keys in plan.copies.items():
        assert all(dest in new.holders(k) and dest not in old.holders(k) for k in keys)


def _cluster(shards: int, params: dict) -> tuple[list[PSShard], list[PSClient]]:
    servers = [PSShard(i, "bsp", ADAMW, WORKERS, LRS, CLIP) for i in range(shards)]
    clients = [PSClient([LocalConn(s) for s in servers], 5, VNODES, worker=w) for w in range(WORKERS)]
    for c in clients:
        c.register(params)
    return servers, clients


def _step(clients: list[PSClient], clock: int) -> dict[str, torch.Tensor]:
    """One BSP step with clipping (the norm is summed over chunks, wherever they live)."""
    gen = torch.Generator().manual_seed(clock)
    for c in clients:
        c.push(clock, {n: torch.randn(tuple(v["shape"]), generator=gen) for n, v in c.layout.items()})
    names = list(clients[0].layout)
    norm = math.sqrt(clients[0].grad_sq(clock, names))
    clients[0].apply(clock, min(1.0, CLIP / (norm + 1e-6)))
    return clients[0].pull(names, clock + 1)


def _resize(servers: list[PSShard], clients: list[PSClient], count: int) -> list[PSShard]:
    """What ``ps_resize.resize`` does through Ray, on local shards: the same plan, handover, take, drop, reshard."""
    keys = [k for c in clients[:1] for n in c.layout for k in c.keys_of(n)]
    plan = rebalance(clients[0].ring, HashRing(count, VNODES), keys)
    servers = servers + [PSShard(i, "bsp", ADAMW, WORKERS, LRS, CLIP) for i in range(len(servers), count)]
    for dest, src, ks in _moves(plan.copies, range(len(clients[0].conns), count)):
        servers[dest].take(servers[src].handover(ks))
    for shard, ks in plan.drops.items():
        servers[shard].drop(ks)
    servers = servers[:count]
    for c in clients:
        c.reshard([LocalConn(s) for s in servers])
    return servers


def test_moved_chunks_train_and_roll_back_exactly_as_unmoved_ones():
    """2 shards grow to 3 after step 1 and shrink to 2 after step 2; a shard's sums do not depend on which
    chunks it holds, so every step equals the fixed 3-shard run's, and a rollback to the step kept before the
    first resize finds each chunk's kept state on its new holder."""
    params = {"stage0.w": torch.randn(6, 7, generator=torch.Generator().manual_seed(0)), "stage0.b": torch.zeros(9)}
    fixed, fixed_clients = _cluster(3, params)
    moving, clients = _cluster(2, params)
    for s in fixed + moving:
        s.keep(0)
    want = [_step(fixed_clients, clock) for clock in range(3)]
    got = [_step(clients, 0)]
    moving = _resize(moving, clients, 3)
    assert moving[2].params and sorted(moving[2].kept) == [0]  # the new shard holds chunks, and their step 0
    got.append(_step(clients, 1))
    moving = _resize(moving, clients, 2)
    got.append(_step(clients, 2))
    assert all(torch.equal(w[n], g[n]) for w, g in zip(want, got) for n in params)
    for s in moving:
        s.roll_back(0)
    for c in clients:
        c.reshard([LocalConn(s) for s in moving])  # a rollback restarts the clocks; the ring is the current one
    assert all(torch.equal(a, b) for a, b in zip(clients[0].pull(list(params)).values(), params.values()))
    assert all(torch.equal(want[0][n], v) for n, v in _step(clients, 0).items())


@pytest.mark.parametrize("resize, field", [
    ([{"at_step": 3, "shards": 2}], "parameter_server.resize[0].shards"),
    ([{"at_step": 4, "shards": 3}, {"at_step": 4, "shards": 2}], "parameter_server.resize[1].at_step"),
    ([{"at_step": 11, "shards": 3}], "parameter_server.resize[0].at_step"),
    ([{"at_step": 1, "shards": 3}], "parameter_server.resize[0].at_step"),
])
def test_bad_resizes_are_refused_naming_the_field(resize, field):
    with pytest.raises(SpecError) as err:
        JobSpec.from_dict({"data": {"path": "d"}, "parallel": {"dp_sync": "ps"}, "train": {"steps": 10},
                           "parameter_server": {"resize": resize}})
    assert err.value.field == field and "fix" in str(err.value)


def test_resize_needs_the_parameter_server_and_moves_kill_ps_shard_checks_with_it():
    with pytest.raises(SpecError, match="dp_sync: ps") as err:
        JobSpec.from_dict({"data": {"path": "d"}, "parameter_server": {"resize": [{"at_step": 2, "shards": 3}]}})
    assert err.value.field == "parameter_server.resize"
    ps = {"dp_sync": "ps"}, {"resize": [{"at_step": 3, "shards": 3}, {"at_step": 6, "shards": 2}]}
    job = JobSpec.from_dict({"data": {"path": "d"}, "parallel": ps[0], "parameter_server": ps[1],
                             "faults": [{"kind": "kill_ps_shard", "shard": 2, "at_step": 4}]})
    assert [job.parameter_server.shards_at(s) for s in (2, 3, 5, 6, 9)] == [2, 3, 3, 2, 2]
    with pytest.raises(SpecError, match="2 shards at step 7") as err:
        JobSpec.from_dict({"data": {"path": "d"}, "parallel": ps[0], "parameter_server": ps[1],
                           "faults": [{"kind": "kill_ps_shard", "shard": 2, "at_step": 7}]})
    assert err.value.field == "faults.0.shard"


def test_a_paused_keeper_holds_even_a_worker_whose_budget_is_spent():
    """asp/ssp: a worker past its last step pulls the final weights; while the controller resizes (paused), that
    pull must wait, or it would read a ring whose chunks are half moved."""
    keeper = ClockKeeper(replicas=1, staleness=None, steps=1)
    assert keeper.enter(0) and keeper.tick(0) == 1
    keeper.pause()
    answer: list[bool] = []
    late = threading.Thread(target=lambda: answer.append(keeper.enter(0)))
    late.start()
    late.join(timeout=0.3)
    assert late.is_alive() and answer == []
    keeper.resume()
    late.join(timeout=5)
    assert answer == [False]  # budget spent: it ends, after the resize
