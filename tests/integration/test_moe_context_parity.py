"""MoE under context parallelism, experts split over ep ranks carved from dp × cp: the single-process reference
(fp32, CPU, 1e-4 relative: losses and global gradient norms) without Ray (tests/support/parity_harness.py).

Each cp rank holds two zigzag chunks of every sequence; ``router: topk`` routes per token and forms its balance
loss from the whole sequence's choice fractions and mean probabilities, averaged over cp
(``workers.model.moe.over_context``); the load the balancing bias moves by is summed over dp × cp. The aux-loss
weight is large (0.1) so a balance loss formed on a cp rank's share alone moves the gradient norm well past
1e-4. Layouts: cp=2 × ep=2 (the cp pair splits the experts, no dp at all), dp=2 × cp=2 with ep=2 and ep=4 (the
four data × context ranks), pp=2 × cp=2 × ep=2 (pp sits between dp and cp in the rank order), on GPT and Llama,
per-sequence routing groups (``group: microbatch`` is per rank's microbatch, which the reference's one whole-batch
forward is not, at dp > 1 as under cp), the pooled balance loss, shared experts, the z-loss and bias balancing;
ZeRO-1 (the experts' state sliced over their dp × cp holders); a dp=2 × cp=2 × ep=4 checkpoint resumed at
dp=4 × ep=2 without cp on the reference curve.
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts
from tests.support.reference import reference_run

STEPS = 2
MOE = {"experts": 4, "router": "topk", "aux_loss_weight": 0.1}
MODELS = {
    "gpt-seq": {"moe": {**MOE, "group": "sequence", "shared_experts": 1, "z_loss_weight": 0.01}},
    "llama-bias": {"arch": "llama", "n_kv_heads": 2, "moe": {**MOE, "group": "sequence", "bias_balancing": True}},
    "llama-pooled": {"arch": "llama", "n_kv_heads": 2, "moe": {**MOE, "balance_loss": "pooled"}},
}
TWO = {  # name: (model, parallel), on 2 ranks
    "gpt-seq-cp2-ep2": ("gpt-seq", {"cp": 2, "ep": 2}),
    "llama-bias-cp2-ep2": ("llama-bias", {"cp": 2, "ep": 2}),
    "llama-pooled-cp2": ("llama-pooled", {"cp": 2}),
}
FOUR = {  # on 4 ranks
    "gpt-seq-dp2-cp2-ep4": ("gpt-seq", {"dp": 2, "cp": 2, "ep": 4}),
    "llama-bias-dp2-cp2-ep2-zero1": ("llama-bias", {"dp": 2, "cp": 2, "ep": 2, "zero": 1}),
    "gpt-seq-pp2-cp2-ep2": ("gpt-seq", {"pp": 2, "cp": 2, "ep": 2}),
    "gpt-seq-saved-dp2-cp2-ep4": ("gpt-seq", {"dp": 2, "cp": 2, "ep": 4}),
    "gpt-seq-resumed-dp4-ep2": ("gpt-seq", {"dp": 4, "ep": 2}),
}


def _spec(token_data, tmp_path, model: str, parallel: dict, steps: int = STEPS):
    return tiny_spec(token_data, tmp_path, model={"n_layers": 2, **MODELS[model]},
                     parallel={**parallel, "device": "cpu"}, train={"steps": steps})


def _check(token_data, tmp_path, layouts: dict, world: int, checkpoints=None, resumes=None) -> dict:
    specs = [_spec(token_data, tmp_path / name, *job).worker_dict() for name, job in layouts.items()]
    runs = dict(zip(layouts, run_layouts(specs, world, STEPS, checkpoints=checkpoints, resumes=resumes)))
    for name, (model, _) in layouts.items():
        if "-saved-" in name or "-resumed-" in name:
            continue
        losses, norms = reference_run(_spec(token_data, tmp_path / f"ref-{name}", model, {}), STEPS)
        assert runs[name].losses == pytest.approx(losses, rel=1e-4), name
        assert runs[name].grad_norms == pytest.approx(norms, rel=1e-4), name
    return runs


def test_moe_cp2_with_experts_over_the_cp_pair_matches_single_process(token_data, tmp_path):
    _check(token_data, tmp_path, TWO, 2)


def test_moe_with_ep_carved_from_dp_and_cp_matches_single_process(token_data, tmp_path):
    saved = str(tmp_path / "ckpt")
    checkpoints = [saved if "-saved-" in name else None for name in FOUR]
    resumes = [saved if "-resumed-" in name else None for name in FOUR]
    runs = _check(token_data, tmp_path, FOUR, 4, checkpoints, resumes)
    losses, norms = reference_run(_spec(token_data, tmp_path / "ref-resumed", "gpt-seq", {}, 2 * STEPS), 2 * STEPS)
    both = (runs["gpt-seq-saved-dp2-cp2-ep4"], runs["gpt-seq-resumed-dp4-ep2"])
    assert both[0].losses + both[1].losses == pytest.approx(losses, rel=1e-4)
    assert both[0].grad_norms + both[1].grad_norms == pytest.approx(norms, rel=1e-4)
