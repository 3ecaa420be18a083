"""Parallel layouts reproduce the single-process reference without Ray (fp32, CPU, 1e-4 relative).

Ranks are spawned processes over gloo on loopback (tests/support/parity_harness.py), so each layout costs
its training and not Ray's actors and controller. The math of a layout (wrappers, schedules, sharded
optimizers) all lives in ``workers.trainer``; tests/integration/test_parity.py keeps one Ray layout per
axis for what Ray adds on top. These layouts moved here from there (and two LoRA layouts from
tests/integration/test_lora_parity.py), with the same steps and tolerance.
Integration, not unit: spawning the ranks and importing torch in each takes seconds per layout.
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layout
from tests.support.reference import reference_run

STEPS = 10

LAYOUTS = {
    "tp2-no-sp": {"tp": 2, "sequence_parallel": False},
    "tp2-dp2-zero3": {"tp": 2, "dp": 2, "zero": 3},
    "pp2-dp2-gpipe": {"pp": 2, "dp": 2, "pp_schedule": "gpipe"},
    "pp2-dp2-interleaved_1f1b": {"pp": 2, "dp": 2, "pp_schedule": "interleaved_1f1b"},
    "pp2-dp2-interleaved_zero_bubble": {"pp": 2, "dp": 2, "pp_schedule": "interleaved_zero_bubble"},
    "pp2-dp2-zbv": {"pp": 2, "dp": 2, "pp_schedule": "zbv"},
    "pp2-dp2-dualpipev": {"pp": 2, "dp": 2, "pp_schedule": "dualpipev"},
    "pp2-tp2-dp2": {"pp": 2, "tp": 2, "dp": 2},
    "dp2-zero1": {"dp": 2, "zero": 1},
    "dp2-zero2": {"dp": 2, "zero": 2},
    "pp2-dp2-zero3-interleaved": {"pp": 2, "dp": 2, "zero": 3, "pp_schedule": "interleaved_1f1b"},
}

LORA_STEPS = 5
LORA = {"rank": 4, "alpha": 8.0}
# moved from tests/integration/test_lora_parity.py, which keeps dp2-zero3 through Ray
LORA_LAYOUTS = {
    "tp2-sp": ({"tp": 2}, {"targets": ["wq", "wk", "wv", "wo", "w1", "w2", "output"]}),
    "pp2-dp2-zero-bubble": ({"pp": 2, "dp": 2, "pp_schedule": "interleaved_zero_bubble"}, {}),
}


@pytest.fixture(scope="module")
def reference(token_data, tmp_path_factory):
    return reference_run(tiny_spec(token_data, tmp_path_factory.mktemp("ref")), STEPS)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process_reference(name, reference, token_data, tmp_path):
    parallel = {**LAYOUTS[name], "device": "cpu"}
    train = {"microbatches": 4} if parallel.get("pp_schedule") == "dualpipev" else {}
    spec = tiny_spec(token_data, tmp_path, parallel=parallel, train=train)
    run = run_layout(spec.worker_dict(), spec.parallel.world_size, STEPS)
    assert len(run.losses) == STEPS
    losses, grad_norms = reference
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4)  # the global norm that clipping uses


@pytest.mark.parametrize("name", list(LORA_LAYOUTS))
def test_lora_layout_matches_single_process_reference(name, token_data, tmp_path):
    parallel, lora = LORA_LAYOUTS[name]
    spec = tiny_spec(token_data, tmp_path, parallel={**parallel, "device": "cpu"},
                     model={"lora": {**LORA, **lora}}, train={"steps": LORA_STEPS})
    losses, grad_norms = reference_run(spec, LORA_STEPS)
    run = run_layout(spec.worker_dict(), spec.parallel.world_size, LORA_STEPS)
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4)
