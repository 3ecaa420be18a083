"""A BPE-tokenised corpus end to end: parity with a padded vocabulary, training, exact resume, vocab refusal."""

from __future__ import annotations

import json

import pytest

from orchestrator import TrainingJob
from orchestrator.cli import main
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layout, run_spec
from tests.support.reference import reference_run


def data_vocab(path) -> int:
    return json.loads((path / "manifest.json").read_text())["vocab_size"]


def test_tp2_with_an_odd_vocabulary_matches_the_reference(bpe_token_data, tmp_path):
    vocab = data_vocab(bpe_token_data) | 1  # odd: tp=2 pads it by one row the data never targets
    spec = tiny_spec(bpe_token_data, tmp_path, model={"vocab_size": vocab}, parallel={"tp": 2})
    assert spec.worker_dict()["model"]["vocab_size"] == vocab + 1
    losses, norms = reference_run(spec, 5)
    run = run_layout(spec.worker_dict(), world_size=2, steps=5)
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(norms, rel=1e-4)


def test_bpe_training_falls_and_resumes_bit_identically(ray_cluster, bpe_token_data, tmp_path):
    def spec(where, steps, **checkpoint):
        return tiny_spec(bpe_token_data, tmp_path / where, model={"vocab_size": data_vocab(bpe_token_data)},
                         parallel={"dp": 2}, optim={"lr": 1e-2}, train={"steps": steps}, checkpoint=checkpoint)

    def run(where, steps, resume=False, **checkpoint):
        return TrainingJob(spec(where, steps, **checkpoint), resume=resume, progress=False).run()

    straight = run_spec(spec("a", 8))  # uninterrupted, in the harness: a Ray job's bits
    first = run("b", 4, every=4)
    second = run("b", 8, resume=True)
    assert sum(straight.losses[-2:]) / 2 < straight.losses[0] - 0.5, straight.losses
    assert second.resumed_from == first.checkpoints[0]
    assert first.losses + second.losses == straight.losses


def test_a_model_vocabulary_below_the_data_is_refused_before_start(bpe_token_data, tmp_path, capsys):
    rc = main(["run", "examples/bpe_pretrain.yaml", "--no-progress", "--set", f"data.path={bpe_token_data}",
               "--set", f"run_dir={tmp_path}", "--set", "model.vocab_size=256"])
    err = capsys.readouterr().err
    assert rc == 2 and "model.vocab_size" in err and f"set model.vocab_size: {data_vocab(bpe_token_data)}" in err
