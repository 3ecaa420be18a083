"""`checkpoint.keep_best` and `--checkpoint best`: each checkpoint of a step that scored the held-out loss carries
it (under its checksums), retention spares the lowest, and the summary, the `done` lines and the readers of a
checkpoint find it. On the fake rank group, whose held-out loss here falls, rises and falls again."""

from __future__ import annotations

import json

import pytest

from orchestrator import JobSpec, TrainingJob
from orchestrator.checkpoints import checksums
from orchestrator.checkpoints.directory import CheckpointDir
from orchestrator.cli.follow import _where
from orchestrator.errors import SpecError
from orchestrator.spec.lora import checkpoint_to_read
from orchestrator.spec.runtime_checks import check_outputs
from tests.support.fake_group import FakeRuntime
from tests.support.jobs import tiny_spec
from tests.support.spec_errors import assert_actionable, spec_error

CURVE = {2: 3.0, 4: 2.0, 6: 1.5, 8: 1.7, 10: 1.9, 12: 1.2, 14: 1.6, 16: 1.8}  # best at 6, then at 12


def _job(tmp_path, keep_best=True, steps=10, **checkpoint):
    spec = tiny_spec(tmp_path / "data", tmp_path, parallel={"dp": 2}, train={"steps": steps},
                     checkpoint={"every": 2, "keep": 2, "memory_every": 1, "keep_best": keep_best, **checkpoint},
                     eval={"every": 2, "path": "/held"})
    return spec, TrainingJob(spec, progress=False, runtime=FakeRuntime(held_out=CURVE.__getitem__))


@pytest.mark.parametrize("async_save", [True, False])
def test_the_best_checkpoint_outlives_keep_and_carries_its_loss_under_the_checksums(tmp_path, async_save):
    spec, job = _job(tmp_path, **{"async": async_save})
    result = job.run()
    assert job.ckpt.complete_steps() == [6, 8, 10]  # keep 2 newest, and step 6 (held-out 1.5) besides
    assert result.best_checkpoint == {"step": 6, "path": str(job.ckpt.path_for(6)), "eval_loss": 1.5}
    assert [job.ckpt.score(s) for s in (6, 8, 10)] == [1.5, 1.7, 1.9]
    sealed = json.loads((job.ckpt.path_for(6) / checksums.MANIFEST).read_text())["files"]
    assert "eval.json" in sealed and checksums.problem(job.ckpt.path_for(6)) is None
    assert checkpoint_to_read(spec, "best", "generate from") == job.ckpt.path_for(6)
    lines = _where(result.to_dict(), None)
    assert f"best checkpoint (held-out loss 1.5000): {job.ckpt.path_for(6)}" in lines


def test_a_better_checkpoint_takes_over_and_the_old_best_goes_with_retention(tmp_path):
    _, job = _job(tmp_path, steps=16)
    result = job.run()
    assert job.ckpt.complete_steps() == [12, 14, 16] and result.best_checkpoint["step"] == 12


def test_without_keep_best_retention_is_by_age_and_best_reads_what_is_left(tmp_path):
    spec, job = _job(tmp_path, keep_best=False)
    result = job.run()
    assert job.ckpt.complete_steps() == [8, 10]
    assert result.best_checkpoint["step"] == 8 and checkpoint_to_read(spec, "best", "export") == job.ckpt.path_for(8)


def test_a_resumed_run_ranks_the_checkpoints_its_first_part_saved(tmp_path):
    """The losses live with the checkpoints, not in the controller: a resume still spares the first part's best."""
    _, job = _job(tmp_path, steps=6)
    job.run()
    spec = JobSpec.from_dict({**job.spec.to_dict(), "train": {**job.spec.to_dict()["train"], "steps": 10}})
    check_outputs(spec)  # the Ray runtime's preflight: each scored save's eval.json is raymesh's own file
    resumed = TrainingJob(spec, resume=True, progress=False, runtime=FakeRuntime(held_out=CURVE.__getitem__))
    assert resumed.run().best_checkpoint["step"] == 6
    assert resumed.ckpt.complete_steps() == [6, 8, 10]


def test_best_is_the_lowest_score_and_the_earliest_of_equals(tmp_path):
    ckpt = CheckpointDir(tmp_path, keep=1, keep_best=True)
    for step, loss in ((1, 2.0), (2, 1.0), (3, 1.0), (4, None), (5, 3.0)):
        ckpt.path_for(step).mkdir()
        (ckpt.path_for(step) / ".metadata").write_text("{}")
        if loss is not None:
            ckpt.record_score(step, loss)
        ckpt.seal(step)
    assert ckpt.best() == 2 and ckpt.best(upto=1) == 1
    assert ckpt.prune(5) == [1, 3, 4] and ckpt.complete_steps() == [2, 5]


def test_best_without_any_scored_checkpoint_is_refused_with_the_fix(tmp_path):
    spec = tiny_spec(tmp_path / "data", tmp_path)
    with pytest.raises(SpecError) as err:
        checkpoint_to_read(spec, "best", "generate from")
    assert_actionable(err.value, "--checkpoint", "best", "eval.every dividing checkpoint.every")


@pytest.mark.parametrize(("sections", "field", "value", "fix"), [
    ({"checkpoint": {"keep_best": True}}, "checkpoint.keep_best", True, "set eval.every and eval.path"),
    ({"checkpoint": {"keep_best": True, "every": 0}, "eval": {"every": 5, "path": "/h"}}, "checkpoint.keep_best",
     True, "set checkpoint.every to a multiple of eval.every (5)"),
    ({"checkpoint": {"keep_best": True, "every": 50}, "eval": {"every": 20, "path": "/h"}}, "checkpoint.every", 50,
     "set checkpoint.every to a multiple of 20 (e.g. 40)"),
])
def test_keep_best_needs_every_checkpoint_to_be_scored(tmp_path, sections, field, value, fix):
    raw = {"data": {"path": str(tmp_path)}, "run_dir": str(tmp_path / "run"), **sections}
    assert_actionable(spec_error(raw), field, value, fix)
