"""The shards' checkpoint part, no Ray: whole tensors by name survive a DCP round trip, and shards rebuilt from them
for another shard count and chunk size take the next BSP step exactly as the shards that saved them would have."""

from __future__ import annotations

import pytest
import torch

from parameter_server import checkpoint
from parameter_server.client import PSClient
from parameter_server.ring import HashRing
from parameter_server.shard import PSShard
from tests.support.blocking import CountingCondition
from tests.support.jobs import wait_for
from tests.support.ps_local import LocalConn

ADAMW = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.95], "momentum": 0.0}
LRS = [0.1, 0.05, 0.02, 0.01]
WORKERS = 2


def cluster(shards: int, chunk_elems: int, params: dict) -> tuple[list[PSShard], list[PSClient]]:
    servers = [PSShard(i, "bsp", ADAMW, WORKERS, LRS) for i in range(shards)]
    clients = [PSClient([LocalConn(s) for s in servers], chunk_elems, 16, worker=w) for w in range(WORKERS)]
    for c in clients:
        c.register(params)
    return servers, clients


def bsp_step(clients: list[PSClient], clock: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    for c in clients:
        c.push(clock, {n: torch.randn(tuple(v["shape"]), generator=gen) for n, v in c.layout.items()})
    names = list(clients[0].layout)
    clients[0].apply(clock, 1.0)  # no clipping: the norm's sum over chunks would follow the chunk size
    return clients[0].pull(names, clock + 1)


def test_resharded_shards_take_the_next_step_bit_identically(tmp_path):
    params = {"stage0.w": torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), "stage0.b": torch.zeros(7)}
    servers, clients = cluster(3, 5, params)
    for clock in range(2):
        bsp_step(clients, clock, seed=clock)
    flat = checkpoint.whole([s.state() for s in servers], 5, {"workers": WORKERS, "version": 2,
                                                              "applied_from": [0] * WORKERS})
    assert set(flat) >= {"ps.param/stage0.w", "ps.opt/stage0.w/exp_avg_sq", "ps.opt/stage0.w/step",
                         "ps.clock/version"}
    assert flat["ps.opt/stage0.w/exp_avg"].shape == (24,) and float(flat["ps.opt/stage0.w/step"]) == 2
    checkpoint.save(flat, tmp_path)
    loaded = checkpoint.load(tmp_path)
    assert loaded.keys() == flat.keys() and all(torch.equal(loaded[k], flat[k]) for k in flat)
    assert checkpoint.load(tmp_path / "elsewhere") is None  # an all-reduce run's checkpoint has no ps/ folder

    fresh, fresh_clients = cluster(2, 4, {n: torch.full_like(p, 9.0) for n, p in params.items()})
    states = checkpoint.shard_states(loaded, HashRing(2, 16), 4, ADAMW)
    for shard, state in zip(fresh, states):
        shard.restore({**state, "version": 2, "applied_from": [0] * WORKERS})
    assert all(torch.equal(a, b) for a, b in zip(clients[0].pull(list(params)).values(),
                                                  fresh_clients[0].pull(list(params)).values()))
    want, got = bsp_step(clients, 2, seed=7), bsp_step(fresh_clients, 2, seed=7)
    assert all(torch.equal(want[n], got[n]) for n in params)  # Adam's moments and step came along exactly


def test_restore_ends_a_wait_on_a_discarded_clock():
    """A rollback while a worker waits for a clock that will never complete fails that wait at once."""
    import threading

    shard = PSShard(0, "bsp", ADAMW, WORKERS, LRS)
    shard.cond = CountingCondition()
    shard.register({"w#0": torch.ones(3)})
    shard.push(0, 0, {"w#0": torch.ones(3)})  # worker 1 dies before pushing
    errors = []
    waiter = threading.Thread(target=lambda: _catch(errors, lambda: shard.apply(0, 1.0, timeout_s=30)))
    waiter.start()
    wait_for(lambda: shard.cond.waits, 60, "the apply to wait for worker 1's push", poll_s=0.001)
    state = shard.state()
    shard.restore({**state, "version": 0, "applied_from": [0, 0]})
    waiter.join(timeout=10)
    assert not waiter.is_alive() and "aborted or rolled back (version 0)" in str(errors[0])
    assert shard.staged == {}


def _catch(errors: list, call) -> None:
    try:
        call()
    except RuntimeError as exc:
        errors.append(exc)


def test_abort_refuses_pushes_and_waits_until_the_rollback():
    """A survivor that reaches the shards only after the abort fails at once too (not after WAIT_S)."""
    shard = PSShard(0, "bsp", ADAMW, WORKERS, LRS)
    shard.register({"w#0": torch.ones(3)})
    shard.keep(0)
    shard.push(0, 0, {"w#0": torch.ones(3)})
    shard.abort()
    with pytest.raises(RuntimeError, match="rolled back with the ranks; nothing applied"):
        shard.push(1, 0, {"w#0": torch.ones(3)})
    with pytest.raises(RuntimeError, match="aborted or rolled back"):
        shard.grad_sq(0, ["w#0"], timeout_s=30)
    shard.roll_back(0)
    for worker in range(WORKERS):
        shard.push(worker, 0, {"w#0": torch.ones(3)})
    assert shard.apply(0, 1.0) == 1
    with pytest.raises(LookupError, match=r"no state kept at step 3 \(kept: \[0\]\)"):
        shard.roll_back(3)


def test_a_resume_steps_the_shards_at_the_job_files_hyperparameters_with_the_checkpoints_moments(tmp_path):
    """`--resume --set optim.weight_decay=... optim.betas=... optim.lr=...` under dp_sync: ps: the shards are rebuilt
    from the job file (`shard_states` gets its optimizer, `PSShard` its learning rates), so they step at its values;
    the moments and step counts are the checkpoint's, as on the ranks (`TrainState.load_state_dict`)."""
    params = {"stage0.w": torch.randn(4, 6, generator=torch.Generator().manual_seed(0))}
    servers, clients = cluster(2, 5, params)
    for clock in range(2):
        bsp_step(clients, clock, seed=clock)
    flat = checkpoint.whole([s.state() for s in servers], 5, {"workers": WORKERS, "version": 2,
                                                              "applied_from": [0] * WORKERS})
    checkpoint.save(flat, tmp_path)
    changed, lrs = {**ADAMW, "lr": 5e-3, "weight_decay": 0.0, "betas": [0.8, 0.9]}, [0.5] * 4
    fresh = [PSShard(i, "bsp", changed, WORKERS, lrs) for i in range(2)]
    for shard, state in zip(fresh, checkpoint.shard_states(checkpoint.load(tmp_path), HashRing(2, 16), 5, changed)):
        shard.restore({**state, "version": 2, "applied_from": [0] * WORKERS})
    fresh_clients = [PSClient([LocalConn(s) for s in fresh], 5, 16, worker=w) for w in range(WORKERS)]
    for c in fresh_clients:
        c.register({n: torch.zeros_like(p) for n, p in params.items()})  # held keys: the restored values win
    opts = [opt for s in fresh for opt in s.opts.values()]
    groups = [opt.param_groups[0] for opt in opts]
    assert {(g["weight_decay"], tuple(g["betas"])) for g in groups} == {(0.0, (0.8, 0.9))}
    assert {float(opt.state[opt.param_groups[0]["params"][0]]["step"]) for opt in opts} == {2.0}
    before = fresh_clients[0].pull(list(params), 2)["stage0.w"]
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(4, 6, generator=gen) for _ in range(WORKERS)]
    for c, g in zip(fresh_clients, grads):
        c.push(2, {"stage0.w": g})
    fresh_clients[0].apply(2, 1.0)
    expected = torch.nn.Parameter(before.clone())  # torch's AdamW at the job's values, the checkpoint's moments
    adamw = torch.optim.AdamW([expected], lr=0.5, weight_decay=0.0, betas=(0.8, 0.9), foreach=False)
    adamw.state[expected] = {"step": torch.tensor(2.0), "exp_avg": flat["ps.opt/stage0.w/exp_avg"].view(4, 6).clone(),
                             "exp_avg_sq": flat["ps.opt/stage0.w/exp_avg_sq"].view(4, 6).clone()}
    expected.grad = sum(grads) / WORKERS
    adamw.step()
    torch.testing.assert_close(fresh_clients[0].pull(list(params), 3)["stage0.w"], expected.detach(), rtol=0, atol=1e-6)
