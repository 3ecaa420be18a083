"""1-bit Adam's error feedback is each parameter's own: a checkpoint saved with every parameter in one param group
resumes under `optim.weight_decay_exclude: 1d` (two groups, the 1-D parameters moved behind the matrices) with each
error on the parameter that held it, so the step after the resume compresses the same momentum as the uninterrupted
run's. Checkpoints that keyed errors by position (older raymesh) still load where the groups are unchanged, and are
refused, naming the checkpoint and the fix, where a position would now name another parameter."""

from __future__ import annotations

import pytest
import torch

from tests.support.one_rank import one_rank_trainer
from workers.optim.onebit_adam import ParameterErrors

ONE_GROUP = {"name": "onebit_adam", "warmup_steps": 1, "lr": 1e-3, "weight_decay": 0.1,
             "weight_decay_exclude": "none"}
TWO_GROUPS = {**ONE_GROUP, "weight_decay_exclude": "1d"}
SAVED_AT = 3  # steps before the save: the last two compress, so every parameter holds an error


def _momenta(trainer) -> dict[str, torch.Tensor]:
    """Each named parameter's momentum after the optimizer's last step (the compressed average, which the error
    fed into)."""
    opt = trainer.state.optimizers[0]
    return {n: opt.state[p]["exp_avg"].clone() for n, p in trainer.parts.modules[0].named_parameters()}


def _positional_state_dict(self: ParameterErrors) -> dict[str, torch.Tensor]:
    """What raymesh wrote before errors were keyed by name: each under its position in the param groups."""
    return {f"{ParameterErrors.OLD}{i}": self.errors[n].detach().to("cpu", copy=True)
            for i, n in enumerate(self.optimizer.step_order()) if n in self.errors}


def _saved_and_continued(tmp_path_factory, path) -> dict[str, torch.Tensor]:
    """Train ``SAVED_AT`` steps in one group, save to ``path``, train one more: that step's momenta."""
    with one_rank_trainer(tmp_path_factory, optim=ONE_GROUP) as t:
        assert len(t.state.optimizers[0].param_groups) == 1
        for _ in range(SAVED_AT):
            t.train_step()
        assert t.state.optimizers[0].feedback.errors  # compressed steps left an error to carry
        t.checkpoints.save(path, async_save=False)
        t.train_step()
        return _momenta(t)


def _resumed(tmp_path_factory, path, optim: dict) -> dict[str, torch.Tensor]:
    """Load ``path`` under ``optim`` and take one step: its momenta."""
    with one_rank_trainer(tmp_path_factory, optim=optim) as t:
        t.checkpoints.load(path)
        t.train_step()
        return _momenta(t)


def test_error_feedback_saved_in_one_group_lands_on_its_parameters_in_two(tmp_path_factory, tmp_path):
    continued = _saved_and_continued(tmp_path_factory, tmp_path / "ckpt")
    resumed = _resumed(tmp_path_factory, tmp_path / "ckpt", TWO_GROUPS)
    assert resumed.keys() == continued.keys()
    assert all(torch.equal(resumed[n], continued[n]) for n in continued)


def test_a_position_keyed_checkpoint_loads_under_its_own_groups_and_is_refused_under_others(
        tmp_path_factory, tmp_path, monkeypatch):
    with monkeypatch.context() as old_writer:
        old_writer.setattr(ParameterErrors, "state_dict", _positional_state_dict)
        continued = _saved_and_continued(tmp_path_factory, tmp_path / "ckpt")
    resumed = _resumed(tmp_path_factory, tmp_path / "ckpt", ONE_GROUP)
    assert all(torch.equal(resumed[n], continued[n]) for n in continued)
    with pytest.raises(ValueError, match=r"checkpoint .*ckpt keeps 1-bit Adam's error feedback by parameter "
                                         r"position.* 1 param group\(s\), this job's in 2.*weight_decay_exclude=none"):
        _resumed(tmp_path_factory, tmp_path / "ckpt", TWO_GROUPS)
