"""The worker-side seams without Ray: a single-process Trainer returns typed StepResults, its TrainState
round-trips through snapshots and DCP checkpoints, and fault injection is one StepFault hook."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.support.jobs import tiny_spec
from tests.support.one_rank import one_rank_trainer
from workers.diagnostics.faults import NO_FAULT, StepFault
from workers.protocol import StepResult
from workers.spec import WorkerSpec


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    with one_rank_trainer(tmp_path_factory) as t:
        yield t


def test_train_step_returns_a_step_result(trainer):
    result = trainer.train_step()
    assert isinstance(result, StepResult)
    assert result.step == trainer.step == trainer.state.step
    assert result.time_s.step >= result.time_s.compute
    assert StepResult.from_dict(result.to_dict()) == result


def test_snapshot_restores_the_train_state_bit_for_bit(trainer):
    from workers.state import snapshot

    snap = snapshot.take(trainer.state)
    expected = trainer.train_step().loss
    snapshot.restore(trainer.state, snap)
    assert trainer.step == snap["progress"]["step"]
    assert trainer.train_step().loss == expected


def test_a_snapshot_holds_the_bytes_the_planner_reserves_host_memory_for(trainer, tmp_path):
    """``snapshot_memory.snapshot_bytes`` (what each rank's placement asks Ray for, per copy) is the planner's
    weights plus optimizer state: the tensors a real snapshot copies add up to it, to 1%."""
    from orchestrator.planning.snapshot_memory import snapshot_bytes
    from workers.state import snapshot

    trainer.train_step()  # the optimizer's state exists from its first step on
    snap = snapshot.take(trainer.state)
    tensors = [*snap["model"].values(), *(v for state in snap["optim"].values() for v in state.values())]
    held = sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "numel"))
    assert held == pytest.approx(snapshot_bytes(tiny_spec(Path("unused"), tmp_path)), rel=0.01)


def test_checkpoint_restores_the_train_state_bit_for_bit(trainer, tmp_path):
    trainer.checkpoints.save(tmp_path / "ckpt", async_save=False)
    expected = trainer.train_step().loss
    trainer.checkpoints.load(tmp_path / "ckpt")
    assert trainer.train_step().loss == expected


def test_an_async_save_that_failed_raises_once_and_the_next_save_is_written(trainer, tmp_path):
    """A background write's error reaches the controller through one wait; kept, it refused every later save."""
    from concurrent.futures import Future

    failed = Future()
    failed.set_exception(OSError(28, "No space left on device"))
    trainer.checkpoints.pending, trainer.checkpoints.pending_step = failed, trainer.step  # what dcp.async_save left
    assert trainer.checkpoints.durable()
    with pytest.raises(OSError, match="No space left"):
        trainer.checkpoints.wait()
    assert trainer.checkpoints.wait() is None
    trainer.checkpoints.save(tmp_path / "again", async_save=True)
    assert trainer.checkpoints.wait() == trainer.step and (tmp_path / "again" / ".metadata").is_file()


def test_nan_loss_fault_poisons_its_step(trainer):
    """Last on the shared trainer: the NaN gradients are applied (the controller's recovery rolls back)."""
    poisoned = trainer.train_step({"kind": "nan_loss"})
    assert math.isnan(poisoned.loss) and math.isnan(poisoned.grad_norm)


def test_step_fault_hooks():
    assert not NO_FAULT.poisons_loss and NO_FAULT.slow_down(1.0) == 0.0
    assert StepFault({"kind": "nan_loss"}).poisons_loss
    assert StepFault({"kind": "slow_rank", "factor": 1.0}).slow_down(0.5) == 0.0
    NO_FAULT.before()  # no fault: returns at once


def test_worker_spec_names_a_missing_section():
    with pytest.raises(KeyError, match="parallel.dp is missing"):
        WorkerSpec.from_dict({"parallel": {}})


def test_worker_spec_parses_the_dict_the_controller_sends(tmp_path):
    job = tiny_spec(tmp_path / "tokens", tmp_path, parallel={"device": "cpu", "dp": 2})
    spec = WorkerSpec.from_dict(job.worker_dict())
    assert (spec.parallel.dp, spec.parallel.dp_sync, spec.train.microbatches) == (2, "allreduce", 2)
    assert spec.model.ffn_dim == 64 and spec.model.arch == "gpt" and spec.finetune.lora is None
    assert spec.memory.offload.params is False and spec.optim.grad_clip == job.optim.grad_clip
