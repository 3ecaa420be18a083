"""The rank's step is open for extension: a new objective, and a new per-step figure with its hook, are each
registered from one module (this test file) and run through the unchanged Trainer, engines and step records.

This file plays the new feature's module; its registrations are the only other place a feature touches
(``workers/step/objectives.py``'s and ``workers/contract/figures.py``'s registries, as a new model family touches
``workers/model/registry.py``)."""

from __future__ import annotations

import pytest
import torch

from orchestrator.observability.run_records import step_record
from tests.support.one_rank import one_rank_trainer
from workers.contract import figures
from workers.loop.summary import StepSummary
from workers.protocol import StepResult, StepTimes
from workers.step.context import StepHook
from workers.step.hooks import register_hook, unregister_hook
from workers.step.objectives import OBJECTIVES, Objective, register_objective


class SquaredLogits(Objective):
    """A toy loss nobody trains with: the mean squared logit (an objective of its own, not the LM loss)."""

    def loss(self, logits, targets):
        return (logits.float() ** 2).mean()


class MicrobatchCount(StepHook):
    """A toy figure: how many forward+backward events the step ran on this rank (its engine's events)."""

    def after_step(self, ctx):
        ctx.extras["toy_microbatches"] = len(ctx.events)


@pytest.fixture
def toy_parts():
    register_objective("toy_squared_logits", SquaredLogits)
    figures.register(figures.Sum("toy_microbatches"))
    register_hook("toy_microbatches", lambda kit: MicrobatchCount())
    yield
    OBJECTIVES.pop("toy_squared_logits")
    figures.unregister("toy_microbatches")
    unregister_hook("toy_microbatches")


def test_a_registered_objective_and_figure_run_through_the_unchanged_step(toy_parts, tmp_path_factory):
    with one_rank_trainer(tmp_path_factory, objective="toy_squared_logits") as trainer:
        model = trainer.parts.modules[0]
        inputs, _ = trainer.state.cursor.dataset.batch(0, 8)
        with torch.no_grad():
            expected = sum(float((model(x).float() ** 2).mean()) / 2 for x in inputs.chunk(2))
        result = trainer.train_step()
    assert isinstance(trainer.objective, SquaredLogits)
    assert result.loss == pytest.approx(expected, rel=1e-6)  # the toy's loss, not cross entropy (~log 256)
    assert result.extras["toy_microbatches"] == result.toy_microbatches == 2
    ranks = StepSummary.of_all([result, _other_rank(result)])
    record = step_record(ranks, step_s=1.0, tokens=256, end_time=0.0, checkpoint_s=0.0)
    assert record["toy_microbatches"] == 5  # its reducer's merge (a sum) over the ranks, recorded under its key
    assert StepResult.from_dict(result.to_dict()) == result  # the JSON form carries it at the top level


def _other_rank(result: StepResult) -> StepResult:
    return StepResult(rank=1, step=result.step, loss=result.loss, grad_norm=result.grad_norm, lr=result.lr,
                      tokens=result.tokens, applied=True, time_s=StepTimes(), peak_memory_bytes=1,
                      current_memory_bytes=1, toy_microbatches=3)


def test_a_figure_without_a_reducer_is_refused_where_the_result_is_made():
    with pytest.raises(TypeError, match=r"extras \['toy_unknown'\] have no registered step figure.*register a "
                                        r"Figure"):
        StepResult(rank=0, step=1, loss=1.0, grad_norm=1.0, lr=1e-3, tokens=8, applied=True, time_s=StepTimes(),
                   peak_memory_bytes=1, current_memory_bytes=1, toy_unknown=1)


def test_an_unregistered_objective_names_the_field_and_the_known_ones(tmp_path_factory):
    refused = r"train.objective 'toy_missing' has no registered objective \(known: \['dpo', 'lm'"
    with pytest.raises(ValueError, match=refused), one_rank_trainer(tmp_path_factory, objective="toy_missing"):
        pass
