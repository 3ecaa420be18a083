"""``OffloadedAdam`` over bf16 parameters resumes bit for bit: the fp32 master and moments it keeps in the store
survive a save and a load (``load_state_dict``, DCP's ``set_optimizer_state_dict``, an in-memory snapshot) in
fp32, not rounded to the parameters' dtype. CPU only, no process group."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from workers.offload.optimizer import OffloadedAdam
from workers.offload.store import OffloadStore
from workers.state import snapshot
from workers.state.train_state import TrainState

FLAT = StateDictOptions(strict=False, flatten_optimizer_state_dict=True)  # what TrainState's checkpoints use


class _Cursor:
    """The data position, which no step here moves."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).bfloat16()


def _optimizer(model: torch.nn.Module) -> OffloadedAdam:
    return OffloadedAdam(model.parameters(), OffloadStore("cpu"), lr=1e-2, weight_decay=0.1)


def _steps(model: torch.nn.Module, opt: OffloadedAdam, steps: range) -> None:
    """bf16 gradients that depend on the step only, so two optimizers see the same ones at the same step."""
    for step in steps:
        for i, p in enumerate(model.parameters()):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i)).bfloat16()
        opt.step()


def _save_and_load(how: str, model: torch.nn.Module, opt: OffloadedAdam, fresh: torch.nn.Module,
                   resumed: OffloadedAdam) -> None:
    """What each resume path does between the interrupted optimizer and a fresh one over a copy of its weights."""
    if how == "load_state_dict":
        resumed.load_state_dict(opt.state_dict())
    elif how == "dcp":
        set_optimizer_state_dict(fresh, resumed, get_optimizer_state_dict(model, opt, options=FLAT), options=FLAT)
    else:
        snapshot.restore(_train_state(fresh, resumed), snapshot.take(_train_state(model, opt)))


def _train_state(model: torch.nn.Module, opt: OffloadedAdam) -> TrainState:
    return TrainState([model], [opt], [torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)], _Cursor())


@pytest.mark.parametrize("how", ["load_state_dict", "dcp", "snapshot"])
def test_a_resumed_bf16_optimizer_steps_like_the_uninterrupted_one(how):
    """Before: the master was not saved (a fresh one was made from the bf16 weights, losing the bits below their
    rounding) and PyTorch's load cast the fp32 moments to bf16; the weights drifted apart from the next step on."""
    whole = _model()
    whole_opt = _optimizer(whole)
    _steps(whole, whole_opt, range(6))

    model = _model()
    opt = _optimizer(model)
    _steps(model, opt, range(3))
    fresh = _model(seed=1)
    fresh.load_state_dict(model.state_dict())
    resumed = _optimizer(fresh)
    _save_and_load(how, model, opt, fresh, resumed)
    _steps(fresh, resumed, range(3, 6))

    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), fresh.parameters()))
    theirs, ours = whole_opt.state_dict()["state"], resumed.state_dict()["state"]
    for i in theirs:
        assert set(ours[i]) == {"step", "exp_avg", "exp_avg_sq", "master"}
        assert all(ours[i][k].dtype == torch.float32 and torch.equal(theirs[i][k], ours[i][k]) for k in theirs[i])
