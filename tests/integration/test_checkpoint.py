"""Sharded checkpoints: exact resume, resharding to another layout, retention, async saves."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from orchestrator import SpecError, TrainingJob
from orchestrator.checkpoints.directory import CheckpointDir
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_spec
from tests.support.reference import reference_losses

PP_DP = {"pp": 2, "dp": 2}


def run(spec, resume=False):
    return TrainingJob(spec, resume=resume, progress=False).run()


def test_resume_at_step_20_matches_an_uninterrupted_40_step_run(ray_cluster, token_data, tmp_path):
    # uninterrupted: in the Ray-free harness, which gives a Ray job's bits without its controller and actors
    straight = run_spec(tiny_spec(token_data, tmp_path / "a", parallel=PP_DP, train={"steps": 40}))
    first = run(tiny_spec(token_data, tmp_path / "b", parallel=PP_DP, train={"steps": 20},
                          checkpoint={"every": 20, "async": True}))
    second = run(tiny_spec(token_data, tmp_path / "b", parallel=PP_DP, train={"steps": 40}), resume=True)
    assert first.checkpoints == [str(tmp_path / "b" / "run" / "checkpoints" / "step-00000020")]
    saved = Path(first.checkpoints[0])  # written by the ranks' DCP under their umask: private once sealed
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in [saved, *saved.rglob("*")]} == {
        p.name: 0o700 if p.is_dir() else 0o600 for p in [saved, *saved.rglob("*")]}
    assert second.resumed_from == first.checkpoints[0]
    assert first.losses == straight.losses[:20]
    assert second.losses == straight.losses[20:]  # bit-identical: weights, Adam moments, LR and data position


def test_dp4_checkpoint_resumes_at_dp2_and_at_pp2_dp2(ray_cluster, token_data, tmp_path):
    expected = reference_losses(tiny_spec(token_data, tmp_path / "ref", train={"steps": 30}), 30)
    base = tiny_spec(token_data, tmp_path, parallel={"dp": 4, "zero": 3}, train={"steps": 20},
                     checkpoint={"every": 5, "keep": 2})
    saved = run(base)
    assert [Path(p).name for p in saved.checkpoints] == [f"step-{s:08d}" for s in (5, 10, 15, 20)]
    assert CheckpointDir(base.checkpoint.resolved_dir(base.resolved_run_dir()), 2).complete_steps() == [15, 20]
    assert saved.losses == pytest.approx(expected[:20], rel=1e-4)
    for layout in ({"dp": 2}, {"pp": 2, "dp": 2, "zero": 2}):
        resumed = run(base.with_overrides([f"parallel.{k}={v}" for k, v in {"dp": 1, "zero": 0, **layout}.items()]
                                          + ["train.steps=30", "checkpoint.every=0"]), resume=True)
        assert resumed.resumed_from.endswith("step-00000020")
        assert resumed.losses == pytest.approx(expected[20:], rel=1e-4), layout


def test_resume_without_a_checkpoint_is_refused_not_started_over(token_data, tmp_path):
    """The user asked to continue a run: with nothing to continue from, starting over at step 0 is not what was
    asked (refused before Ray is even reached)."""
    with pytest.raises(SpecError, match=r"`--resume`.*finds no checkpoint: the job never saved one.*fix: to start "
                                        r"over, run without --resume"):
        run(tiny_spec(token_data, tmp_path, train={"steps": 2}), resume=True)
