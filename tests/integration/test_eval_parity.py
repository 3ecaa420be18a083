"""The held-out loss (`eval:`) of every kind of layout equals the single-process reference's (fp32, CPU, 1e-4
relative), and scoring it changes no bit of training.

Ray-free (tests/support/parity_harness.py): one spawn of 4 ranks trains every layout in turn. The layouts cover
each way a rank holds its share of the model as the evaluation meets it: ZeRO-3's shards gathered, ZeRO-1's sliced
optimizer, tensor and sequence parallelism, pipelines with two stages per rank (loop placement over 2 and 4 ranks,
and V placement, where the sweep hands a stage its neighbour in place), context parallelism's sequence shares
(Ulysses, GQA), and experts split over ranks with a router that is noisy only in training. The reference scores
the whole evaluation set through the whole model at once (tests/support/reference.py::reference_eval).
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts
from tests.support.reference import reference_eval

STEPS = 4
WORLD = 4
LLAMA = {"arch": "llama", "n_kv_heads": 2}
LAYOUTS = {
    "dp4-zero3": {"parallel": {"dp": 4, "zero": 3}},
    "tp2-dp2-zero1": {"parallel": {"tp": 2, "dp": 2, "zero": 1}},
    "pp2-tp2-interleaved": {"parallel": {"pp": 2, "tp": 2, "pp_schedule": "interleaved_1f1b"}},
    "pp2-dp2-zbv": {"parallel": {"pp": 2, "dp": 2, "pp_schedule": "zbv", "zero": 2}},
    # four ranks, two stages each in loop placement: every rank sends ahead while its next stage's input is on its
    # way back, which blocking sends would deadlock
    "pp4-interleaved": {"parallel": {"pp": 4, "pp_schedule": "interleaved_1f1b"}, "model": {"n_layers": 8},
                        "train": {"microbatches": 4}},
    "cp2-dp2-ulysses-llama": {"parallel": {"cp": 2, "dp": 2, "cp_impl": "ulysses"}, "model": LLAMA},
    "dp4-ep2-noisy-moe": {"parallel": {"dp": 4, "ep": 2}, "model": {"moe": {"experts": 4, "router": "noisy_topk"}}},
}
UNSCORED = "pp2-tp2-interleaved"  # trained again without the eval section: the two runs must agree bit for bit


def _spec(heldout, token_data, tmp_path, layout: dict, scored: bool = True):
    held = {"every": 2, "path": str(heldout), "batches": 2} if scored else {}
    sections = {**layout, "parallel": {**layout["parallel"], "device": "cpu"},
                "train": {"steps": STEPS, **layout.get("train", {})}}
    return tiny_spec(token_data, tmp_path, eval=held, **sections)


@pytest.fixture(scope="module")
def runs(token_data, heldout_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval-parity")
    specs = {name: _spec(heldout_data, token_data, tmp, layout) for name, layout in LAYOUTS.items()}
    specs["unscored"] = _spec(heldout_data, token_data, tmp, LAYOUTS[UNSCORED], scored=False)
    done = run_layouts([s.worker_dict() for s in specs.values()], WORLD, STEPS)
    return {name: (specs[name], run) for name, run in zip(specs, done)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_held_out_loss_equals_the_single_process_reference(runs, name):
    spec, run = runs[name]
    expected = reference_eval(spec, STEPS)
    assert list(expected) == [2, 4]
    assert run.eval_losses == pytest.approx(expected, rel=1e-4)
    for step_results in zip(*run.results.values()):  # every rank scored on the same steps, and said how long
        scored = [r for r in step_results if "eval_s" in r]
        assert len(scored) in (0, WORLD) and all(r["eval_s"] > 0 for r in scored)


def test_scoring_changes_no_bit_of_training(runs):
    (_, scored), (_, unscored) = runs[UNSCORED], runs["unscored"]
    assert scored.losses == unscored.losses and scored.grad_norms == unscored.grad_norms
    assert unscored.eval_losses == {}
