"""A checkpoint saved at one ``parallel.ep`` resumes at another, ep=1 included, on the uninterrupted curve.

Every direction between ep=2 and ep=1 at dp=2 (plain data parallelism, ZeRO-3 → ZeRO-0, ZeRO-1 → ZeRO-1), with 2
steps before the save and 2 after, in one spawn of 2 gloo ranks (``run_layouts``, no Ray). The reference is the
single-process run of the same job for 4 steps (fp32, CPU, 1e-4 relative): expert weights and their optimizer
moments must come back whole, whatever the layout that saved them.
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts
from tests.support.reference import reference_run

STEPS = 2
MOE = {"experts": 4, "group": "sequence", "router": "topk"}
RESHARDS = {  # name: (parallel saved at, parallel resumed at)
    "ep2-to-ep1": ({"dp": 2, "ep": 2}, {"dp": 2, "ep": 1}),
    "ep1-to-ep2": ({"dp": 2, "ep": 1}, {"dp": 2, "ep": 2}),
    "ep2-zero3-to-ep1-zero0": ({"dp": 2, "ep": 2, "zero": 3}, {"dp": 2, "ep": 1}),
    "ep1-zero1-to-ep2-zero1": ({"dp": 2, "ep": 1, "zero": 1}, {"dp": 2, "ep": 2, "zero": 1}),
}


def _spec(token_data, tmp_path, parallel: dict, steps: int = STEPS):
    return tiny_spec(token_data, tmp_path, model={"n_layers": 2, "moe": MOE},
                     parallel={**parallel, "device": "cpu"}, train={"steps": steps, "microbatches": 1})


@pytest.fixture(scope="module")
def runs(token_data, tmp_path_factory):
    """Each direction's saving and resuming job, all in one spawn: name -> (saved run, resumed run)."""
    tmp = tmp_path_factory.mktemp("ep_reshard")
    specs, checkpoints, resumes = [], [], []
    for name, (saved_at, resumed_at) in RESHARDS.items():
        specs += [_spec(token_data, tmp / f"{name}-saved", saved_at).worker_dict(),
                  _spec(token_data, tmp / f"{name}-resumed", resumed_at).worker_dict()]
        checkpoints += [str(tmp / name), None]
        resumes += [None, str(tmp / name)]
    out = run_layouts(specs, 2, STEPS, checkpoints=checkpoints, resumes=resumes)
    return {name: (out[2 * i], out[2 * i + 1]) for i, name in enumerate(RESHARDS)}


@pytest.mark.parametrize("name", list(RESHARDS))
def test_checkpoint_resumes_at_another_ep_on_the_uninterrupted_curve(name, runs, token_data, tmp_path):
    losses, grad_norms = reference_run(_spec(token_data, tmp_path, {}, 2 * STEPS), 2 * STEPS)
    saved, resumed = runs[name]
    assert saved.losses + resumed.losses == pytest.approx(losses, rel=1e-4)
    assert saved.grad_norms + resumed.grad_norms == pytest.approx(grad_norms, rel=1e-4)
