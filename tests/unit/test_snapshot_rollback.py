"""A rollback from an in-memory snapshot into the live trainer (what a NaN step gets, without re-forming the ranks)
replays the uninterrupted run bit for bit: also from the snapshot taken before the first step, whose optimizer
holds no state yet, and with an MoE router whose balancing bias is a buffer that moves every step."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.one_rank import one_rank_trainer

MOE = {"experts": 4, "router": "topk", "bias_balancing": True, "bias_update_rate": 0.05}


@pytest.fixture(scope="module")
def trainer_and_first_snapshot(tmp_path_factory):
    """A one-rank MoE trainer with bias balancing, and its snapshot at step 0 (``TrainingJob`` takes one there)."""
    from workers.state import snapshot

    with one_rank_trainer(tmp_path_factory, model={"moe": MOE}) as t:
        yield t, snapshot.take(t.state)


def _router_biases(trainer) -> dict[str, torch.Tensor]:
    return {n: b.clone() for m in trainer.state.modules for n, b in m.named_buffers() if n.endswith("router.bias")}


def test_a_nan_step_rolled_back_to_the_first_snapshot_replays_the_uninterrupted_steps(trainer_and_first_snapshot):
    """The NaN step's Adam moments are dropped with the rollback, not kept because the step-0 snapshot has none
    to overwrite them with; kept, they turned every retry into NaN until the restart budget ran out."""
    from workers.state import snapshot

    trainer, first = trainer_and_first_snapshot
    assert trainer.step == 0 and not first["optim"]
    clean = [trainer.train_step().loss for _ in range(3)]
    snapshot.restore(trainer.state, first)
    trainer.train_step()
    assert math.isnan(trainer.train_step({"kind": "nan_loss"}).loss)
    snapshot.restore(trainer.state, first)
    assert [trainer.train_step().loss for _ in range(3)] == clean


def test_a_rollback_restores_the_routers_balancing_bias(trainer_and_first_snapshot):
    """The bias is a buffer, not a parameter: the snapshot carries it (as a DCP checkpoint does), so the steps
    after a rollback, or after a replaced rank restores a peer's copy into a freshly built model, are the
    uninterrupted ones."""
    from workers.state import snapshot

    trainer, _ = trainer_and_first_snapshot
    trainer.train_step()
    snap, at_snap = snapshot.take(trainer.state), _router_biases(trainer)
    assert set(at_snap) <= set(snap["buffers"]) and any(b.any() for b in at_snap.values())
    clean = [trainer.train_step().loss for _ in range(2)]
    assert any(not torch.equal(b, at_snap[n]) for n, b in _router_biases(trainer).items())  # it moved
    for b in (b for m in trainer.state.modules for n, b in m.named_buffers() if n.endswith("router.bias")):
        b.zero_()  # as a rebuilt model starts it
    snapshot.restore(trainer.state, snap)
    assert all(torch.equal(b, at_snap[n]) for n, b in _router_biases(trainer).items())
    assert [trainer.train_step().loss for _ in range(2)] == clean
