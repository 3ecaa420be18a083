"""The paged optimizer (``memory.offload.page_at``, workers/offload/paged.py): the state leaves for the store only
after a step whose pressure reached the threshold, comes back for the next step, and the weights stay bit-identical
to an optimizer that never paged; checkpoints taken while paged carry the whole state; the spec refuses what it
cannot page. Memory pressure is a probe the tests drive (the real ones read CUDA's allocator or /proc)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orchestrator import JobSpec
from orchestrator.errors import SpecError
from tests.support.one_rank import one_rank_trainer
from workers.offload.paged import StatePager
from workers.offload.store import OffloadStore
from workers.state import snapshot

CAPACITY = 10**9  # bytes the fake device holds: the tiny model's state is a rounding error of it
PAGE_AT = 0.9


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _train(pressures: list[float] | None, tier: str = "cpu", tmp_path=None):
    """A model trained one step per pressure (AdamW; paged at ``PAGE_AT`` when ``pressures`` is given): its
    weights, the optimizer, its pager and whether the state was paged out after each step."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    peaks = iter(pressures or [])
    pager = None
    if pressures is not None:
        pager = StatePager(opt, OffloadStore(tier, str(tmp_path) if tmp_path else None), PAGE_AT,
                           lambda: (int(next(peaks) * CAPACITY), CAPACITY))
    gen = torch.Generator().manual_seed(1)
    paged_after = []
    for _ in range(len(pressures or [0.0] * 6)):
        x = torch.randn(4, 8, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        paged_after.append(pager.is_paged if pager else False)
    return model, opt, pager, paged_after


PRESSURES = [0.5, 0.95, 0.95, 0.3, 0.3, 0.92]


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_state_moves_only_when_the_threshold_is_crossed_and_weights_stay_bit_identical(tier, tmp_path):
    plain, plain_opt, _, _ = _train(None)
    model, opt, pager, paged_after = _train(PRESSURES, tier, tmp_path)
    assert paged_after == [False, True, True, False, False, True]
    assert (pager.pages_out, pager.pages_in) == (3, 2)
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    # paged out now: the state holds only its step count, the store the moments
    assert all(set(opt.state[p]) == {"step"} for p in model.parameters())
    assert len(pager.paged) == 2 * len(list(model.parameters())) and all(k.key in pager.store for k in
                                                                          pager.paged.values())
    saved = opt.state_dict()  # a checkpoint while paged out carries every tensor, as the unpaged one's
    for index, state in plain_opt.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(saved["state"][index][key], value), (index, key)
    assert not pager.is_paged  # state_dict fetched it back


def test_pressure_counts_the_state_that_was_away():
    """A peak of 0.85 with the state resident stays resident; the same peak measured while the state was in the
    store is 0.85 plus the state's share, which (here: state sized at 10% of the device) stays paged."""
    model, opt, _, _ = _train(None)
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim())
    peaks = iter([0.95, 0.85, 0.85])
    pager = StatePager(opt, OffloadStore("cpu"), PAGE_AT, lambda: (int(next(peaks) * state_bytes * 10),
                                                                  state_bytes * 10))
    seen = []
    for _ in range(3):
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        seen.append((pager.is_paged, round(pager.last_pressure, 3)))
    assert seen == [(True, 0.95), (True, 0.95), (True, 0.95)]
    resident = StatePager(_train(None)[1], OffloadStore("cpu"), PAGE_AT, lambda: (85, 100))
    resident.after_step()
    assert not resident.is_paged and resident.last_pressure == pytest.approx(0.85)


def test_loading_a_state_dict_while_paged_replaces_the_stored_copies():
    _, plain_opt, _, _ = _train(None)
    model, opt, pager, _ = _train(PRESSURES)
    assert pager.is_paged
    opt.load_state_dict(plain_opt.state_dict())
    assert not pager.is_paged and not pager.store.nbytes
    for index, p in enumerate(model.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], plain_opt.state_dict()["state"][index]["exp_avg"])


@pytest.mark.parametrize("threshold", [0.0, 1.0])
def test_a_threshold_outside_the_unit_interval_is_refused(threshold):
    with pytest.raises(ValueError, match=r"page_at .* fix"):
        StatePager(torch.optim.AdamW(_model().parameters()), OffloadStore("cpu"), threshold, lambda: (0, 1))


def _train_rank(tmp_path_factory, memory: dict, forced: bool, steps: int = 3):
    """The tiny job at ZeRO-3 on one rank (FSDP2's DTensor parameters) for ``steps`` steps; with ``forced``, its
    pager's probe reports every step at 95% of the device. Losses, weights and what the pager did."""
    with one_rank_trainer(tmp_path_factory, parallel={"zero": 3, "device": "cpu"}, memory=memory,
                          optim={"name": "paged_adamw"} if memory else {"name": "adamw"}) as trainer:
        opt = trainer.state.optimizers[0]
        pager = getattr(opt, "pager", None)
        if forced:
            pager.probe = lambda: (95, 100)
        losses = [trainer.train_step().loss for _ in range(steps)]
        weights = {n: p.full_tensor().clone() for n, p in trainer.parts.modules[0].named_parameters()}
        if forced:  # an in-memory snapshot taken while paged out holds the moments (fetched back for it)
            assert pager.is_paged
            held = snapshot.take(trainer.state)["optim"]
            assert held and all({"exp_avg", "exp_avg_sq"} <= set(state) for state in held.values())
        moved = (pager.pages_out, pager.pages_in, type(opt).__name__) if pager else None
    return losses, weights, moved


def test_paged_adamw_with_page_at_trains_on_the_device_and_pages_fsdp2_state_bit_exactly(tmp_path_factory,
                                                                                           tmp_path):
    memory = {"offload": {"page_at": 0.9, "tier": "nvme", "path": str(tmp_path)}}
    losses, weights, _ = _train_rank(tmp_path_factory, {}, forced=False)
    paged_losses, paged_weights, moved = _train_rank(tmp_path_factory, memory, forced=True)
    assert moved == (3, 3, "AdamW")  # out after every step, back before the next two and for the snapshot
    assert paged_losses == losses
    assert all(torch.equal(paged_weights[n], w) for n, w in weights.items())
    _, _, idle = _train_rank(tmp_path_factory, memory, forced=False)  # this host is far from 90% full
    assert idle == (0, 0, "AdamW")


def _spec(tmp_path, **sections) -> JobSpec:
    return JobSpec.from_dict({"data": {"path": str(tmp_path)}, **sections})


@pytest.mark.parametrize("sections, field", [
    ({"memory": {"offload": {"page_at": 0.9, "optimizer": True}}}, "memory.offload.optimizer"),
    ({"memory": {"offload": {"page_at": 0.9}}, "optim": {"name": "muon"}}, "optim.name"),
    ({"memory": {"offload": {"page_at": 0.9}}, "parallel": {"device": "cpu"}}, "memory.offload.tier"),
    ({"memory": {"offload": {"page_at": 1.5}}}, "memory.offload.page_at"),
])
def test_spec_refuses_what_page_at_cannot_page(sections, field, tmp_path):
    with pytest.raises((SpecError, ValueError), match=field.replace(".", r"\.")):
        _spec(tmp_path, **sections)


def test_spec_accepts_page_at_with_its_store_settings(tmp_path):
    spec = _spec(tmp_path, optim={"name": "paged_adamw"}, parallel={"device": "cpu"},
                 memory={"offload": {"page_at": 0.8, "tier": "nvme", "path": str(tmp_path), "prefetch": 2}})
    assert spec.memory.offload.page_at == 0.8


def test_the_planner_counts_paged_state_on_the_device(tmp_path):
    """paged_adamw alone keeps its moments in the store (not counted on the device); with page_at they are on the
    device whenever a step runs, so the fit check counts them there, as it does AdamW's."""
    from orchestrator.planning.estimate import estimate

    def rows(**offload):
        spec = _spec(tmp_path, optim={"name": "paged_adamw"}, parallel={"device": "cuda"},
                     memory={"offload": offload})
        return estimate(spec)

    adamw = estimate(_spec(tmp_path, parallel={"device": "cuda"}))
    always, paged = rows(), rows(page_at=0.9)
    assert all(r.state.offloaded > 0 and r.state.optimizer == 0 for r in always)
    assert [(r.state.offloaded, r.state.optimizer) for r in paged] == [(0, r.state.optimizer) for r in adamw]
