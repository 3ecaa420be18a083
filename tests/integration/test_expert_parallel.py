"""Expert parallelism reproduces the single-process MoE reference (fp32, CPU, 1e-4 relative) without Ray.

Ranks are spawned gloo processes (tests/support/parity_harness.py). The model is tiny (2 layers, d_model 32,
4 experts) and runs 3 steps; the reference is tests/support/reference.py on the same job with ep left out (the
model code is shared, the dispatch, expert sharding, expert-data-parallel reduction and checkpoints are not).
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layout
from tests.support.reference import reference_run

STEPS = 3
MOE = {"experts": 4, "group": "sequence"}

LAYOUTS = {  # name: (router, parallel, train)
    "topk-dp4-ep2": ("topk", {"dp": 4, "ep": 2}, {}),
    "topk-dp2-ep2-pp2": ("topk", {"dp": 2, "ep": 2, "pp": 2}, {"microbatches": 2}),
}


def _spec(token_data, tmp_path, router: str, parallel: dict, train: dict | None = None):
    return tiny_spec(token_data, tmp_path, model={"n_layers": 2, "moe": {**MOE, "router": router}},
                     parallel={**parallel, "device": "cpu"}, train={"steps": STEPS, "microbatches": 1, **(train or {})})


def _reference(token_data, tmp_path, router: str, train: dict | None = None):
    spec = _spec(token_data, tmp_path / "reference", router, {}, train)
    return reference_run(spec, STEPS)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_layout_matches_single_process_reference(name, token_data, tmp_path):
    router, parallel, train = LAYOUTS[name]
    spec = _spec(token_data, tmp_path, router, parallel, train)
    run = run_layout(spec.worker_dict(), spec.parallel.world_size, STEPS)
    losses, grad_norms = _reference(token_data, tmp_path, router, train)
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4)  # experts' squares summed over ep


def test_ep2_checkpoint_resumes_at_ep4_on_the_reference_curve(token_data, tmp_path):
    """Switch routing (with drops), saved at ep=2 under ZeRO-3 (each expert's rows an FSDP2 shard over edp),
    resumed at ep=4 under ZeRO-0: every step on the reference curve, the ep=2 ones included."""
    saved = str(tmp_path / "ckpt")
    first = _spec(token_data, tmp_path / "a", "switch", {"dp": 4, "ep": 2, "zero": 3})
    head = run_layout(first.worker_dict(), 4, STEPS - 1, checkpoint=saved)
    second = _spec(token_data, tmp_path / "b", "switch", {"dp": 4, "ep": 4})
    tail = run_layout(second.worker_dict(), 4, 1, resume=saved)
    losses, grad_norms = _reference(token_data, tmp_path, "switch")
    assert head.losses + tail.losses == pytest.approx(losses, rel=1e-4)
    assert head.grad_norms + tail.grad_norms == pytest.approx(grad_norms, rel=1e-4)
