"""A resume with a changed job file: what the job file says wins where the run can take it (hyperparameters), and
what the checkpoint cannot be read as is refused before any actor starts, naming the field (one gloo rank in the
test's process, no Ray)."""

from __future__ import annotations

import pytest

from tests.support.one_rank import one_rank_trainer


def test_a_resume_trains_at_the_job_files_hyperparameters_not_the_checkpoints(tmp_path_factory, tmp_path):
    """`--resume --set optim.lr=...` (lowering the rate after a loss spike) used to be ignored: the optimizer's
    param groups and the schedule's base rate were read back from the checkpoint. The moments still are."""
    with one_rank_trainer(tmp_path_factory, optim={"lr": 1e-3, "weight_decay": 0.0, "warmup_steps": 4}) as t:
        t.train_step()
        t.checkpoints.save(tmp_path / "ckpt", async_save=False)
    changed = {"lr": 5e-4, "weight_decay": 0.1, "betas": [0.8, 0.9], "warmup_steps": 4}
    with one_rank_trainer(tmp_path_factory, optim=changed) as t:
        t.checkpoints.load(tmp_path / "ckpt")
        opt = t.state.optimizers[0]
        group = opt.param_groups[0]
        assert (group["weight_decay"], tuple(group["betas"]), group["initial_lr"]) == (0.1, (0.8, 0.9), 5e-4)
        assert all(float(s["step"]) == 1 for s in opt.state.values()) and opt.state  # the moments came back
        assert t.step == 1
        assert t.train_step().lr == pytest.approx(5e-4 * 2 / 4)  # the job's rate, at the saved schedule position
