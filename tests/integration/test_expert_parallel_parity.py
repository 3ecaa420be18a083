"""Expert parallelism reproduces the single-process MoE reference (fp32, CPU, 1e-4 relative) without Ray.

Ranks are spawned gloo processes (tests/support/parity_harness.py), one spawn of 4 ranks for every job here
(``run_layouts``). The model is tiny (2 layers, d_model 32, 4 experts, routing groups per sequence) and each job
runs 2 steps; the reference is tests/support/reference.py on the same job without ep (the model code is shared;
the dispatch, expert sharding, expert-data-parallel reduction and checkpoints are not).
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts
from tests.support.reference import reference_run

STEPS = 2
MOE = {"experts": 4, "group": "sequence"}

LAYOUTS = {  # name: (router, parallel, train)
    "topk-dp4-ep2": ("topk", {"dp": 4, "ep": 2}, {}),
    "noisy_topk-dp4-ep4": ("noisy_topk", {"dp": 4, "ep": 4}, {}),
    "gshard-dp4-ep2-zero2": ("gshard", {"dp": 4, "ep": 2, "zero": 2}, {}),
    "topk-dp4-ep2-zero1": ("topk", {"dp": 4, "ep": 2, "zero": 1}, {}),  # experts' slices over edp, dense over dp
    "expert_choice-dp4-ep2": ("expert_choice", {"dp": 4, "ep": 2}, {}),
    "topk-dp2-ep2-pp2": ("topk", {"dp": 2, "ep": 2, "pp": 2}, {"microbatches": 2}),
}
# switch routing (with drops), saved at ep=2 under ZeRO-3 (each expert's rows an FSDP2 shard over edp), then
# resumed at ep=4 under ZeRO-0 for the next steps; and the same from ZeRO-1 to ZeRO-1
RESHARDS = {  # name: (saved at, resumed at)
    "zero3-to-zero0": (("switch", {"dp": 4, "ep": 2, "zero": 3}, {}), ("switch", {"dp": 4, "ep": 4}, {})),
    # ZeRO-1: the experts' optimizer state is sliced over edp (2 ranks at ep=2, 1 at ep=4)
    "zero1-to-zero1": (("switch", {"dp": 4, "ep": 2, "zero": 1}, {}), ("switch", {"dp": 4, "ep": 4, "zero": 1}, {})),
}


def _spec(token_data, tmp_path, router: str, parallel: dict, train: dict, steps: int = STEPS):
    return tiny_spec(token_data, tmp_path, model={"n_layers": 2, "moe": {**MOE, "router": router}},
                     parallel={**parallel, "device": "cpu"}, train={"steps": steps, "microbatches": 1, **train})


@pytest.fixture(scope="module")
def runs(token_data, tmp_path_factory):
    """Every job of this module, trained in one spawn of 4 ranks: name -> LayoutRun."""
    tmp = tmp_path_factory.mktemp("ep")
    jobs, checkpoints, resumes = dict(LAYOUTS), [None] * len(LAYOUTS), [None] * len(LAYOUTS)
    for name, (saved_at, resumed_at) in RESHARDS.items():
        jobs[f"{name}-saved"], jobs[f"{name}-resumed"] = saved_at, resumed_at
        checkpoints += [str(tmp / name), None]
        resumes += [None, str(tmp / name)]
    specs = [_spec(token_data, tmp / name, *job).worker_dict() for name, job in jobs.items()]
    return dict(zip(jobs, run_layouts(specs, 4, STEPS, checkpoints=checkpoints, resumes=resumes)))


def _reference(token_data, tmp_path, router: str, train: dict, steps: int = STEPS):
    return reference_run(_spec(token_data, tmp_path, router, {}, train, steps), steps)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_layout_matches_single_process_reference(name, runs, token_data, tmp_path):
    router, _, train = LAYOUTS[name]
    losses, grad_norms = _reference(token_data, tmp_path, router, train)
    assert runs[name].losses == pytest.approx(losses, rel=1e-4)
    assert runs[name].grad_norms == pytest.approx(grad_norms, rel=1e-4)  # experts' squares summed over ep


@pytest.mark.parametrize("name", list(RESHARDS))
def test_ep2_checkpoint_resumes_at_ep4_on_the_reference_curve(name, runs, token_data, tmp_path):
    losses, grad_norms = _reference(token_data, tmp_path, "switch", {}, 2 * STEPS)
    saved, resumed = runs[f"{name}-saved"], runs[f"{name}-resumed"]
    assert saved.losses + resumed.losses == pytest.approx(losses, rel=1e-4)
    assert saved.grad_norms + resumed.grad_norms == pytest.approx(grad_norms, rel=1e-4)
