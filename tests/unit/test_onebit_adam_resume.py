"""1-bit Adam's error feedback is each parameter's own: a checkpoint saved with every parameter in one param group
resumes under `optim.weight_decay_exclude: 1d` (two groups, the 1-D parameters moved behind the matrices) with each
error on the parameter that held it, so the step after the resume compresses the same momentum as the uninterrupted
run's. Checkpoints that keyed errors by position (older raymesh) load under either grouping too: their positions are
read in the order the saved groups held the parameters, rebuilt from each one's saved weight decay. Only positions
that fit no parameter of this model are refused, naming the checkpoint and the fix."""

from __future__ import annotations

import pytest
import torch

from tests.support.one_rank import one_rank_trainer
from workers.optim.onebit_adam import OneBitAdam, ParameterErrors

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


def _saved_and_continued(tmp_path_factory, path, optim: dict = ONE_GROUP) -> dict[str, torch.Tensor]:
    """Train ``SAVED_AT`` steps under ``optim``, save to ``path``, train one more: that step's momenta."""
    with one_rank_trainer(tmp_path_factory, optim=optim) as t:
        assert len(t.state.optimizers[0].param_groups) == (1 if optim is ONE_GROUP else 2)
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


@pytest.mark.parametrize(("saved_under", "resumed_under"), [(ONE_GROUP, ONE_GROUP), (ONE_GROUP, TWO_GROUPS),
                                                          (TWO_GROUPS, ONE_GROUP)],
                         ids=["same-groups", "one-into-two", "two-into-one"])
def test_a_position_keyed_checkpoint_lands_on_its_parameters_under_any_grouping(
        tmp_path_factory, tmp_path, monkeypatch, saved_under, resumed_under):
    with monkeypatch.context() as old_writer:
        old_writer.setattr(ParameterErrors, "state_dict", _positional_state_dict)
        continued = _saved_and_continued(tmp_path_factory, tmp_path / "ckpt", saved_under)
    resumed = _resumed(tmp_path_factory, tmp_path / "ckpt", resumed_under)
    assert resumed.keys() == continued.keys()
    assert all(torch.equal(resumed[n], continued[n]) for n in continued)


def _bare(*shapes) -> ParameterErrors:
    """The error feedback of a bare 1-bit Adam over parameters of ``shapes`` (named by position: "0", "1", ...)."""
    return OneBitAdam([torch.nn.Parameter(torch.zeros(s)) for s in shapes]).feedback


@pytest.mark.parametrize(("old", "saved_decay", "why"), [
    ({"error.0": torch.ones(3)}, {"0": 0.1}, "no param-group settings for some of this job's parameters"),
    ({"error.2": torch.ones(3)}, {"0": 0.1, "1": 0.0}, r"error at position 2, past this job's 2 parameters"),
    ({"error.0": torch.ones(3)}, {"0": 0.1, "1": 0.0}, r"position 0 has shape \(3,\), where this job's parameter "
                                                       r"there, 0, has \(2, 2\)"),
], ids=["no-group-settings", "past-the-parameters", "another-shape"])
def test_a_position_keyed_checkpoint_that_fits_no_parameter_is_refused_naming_it(old, saved_decay, why):
    with pytest.raises(ValueError, match=rf"checkpoint ckpt/step_3 keeps 1-bit Adam's error feedback by parameter "
                                         rf"position.*{why}.*fix: resume it with the model it was saved with"):
        _bare((2, 2), (3,)).upgrade(old, saved_decay, "ckpt/step_3")
