"""Expert tensor parallelism (``parallel.expert_tp``) reproduces the single-process reference (fp32, CPU, 1e-4).

At dp2 × ep2 × tp2 (4 ranks: ep borrows its ranks from dp) each expert's w1/w3 columns and w2 rows are split
over the tp pair (``workers.parallel.expert_parallel.split_hidden``), the slices' outputs summed over tp before
the gates weigh them. Checked without Ray (tests/support/parity_harness.py), in one spawn of 4 ranks: GPT with
top-k routing and shared experts under sequence parallelism; Llama (SwiGLU, so w3 is split too) with switch
routing that drops tokens and keyed expert dropout (each tp rank's slice draws its part of the whole hidden's
mask) without sequence parallelism; the GPT once more under ZeRO-1. Besides the losses and gradient norms (the
experts' squares summed over ep × tp): each rank's measured parameter bytes fall by half the routed experts'
against the same layout without expert_tp, and the planner predicts both; a checkpoint saved with expert_tp
resumes at dp4 × ep4 without tp (DCP reshards the whole stacks) on the reference curve.
"""

from __future__ import annotations

import pytest

from orchestrator.planning.estimate import estimate_rank
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts
from tests.support.reference import reference_run

STEPS = 2
ROUTERS = {
    "topk": {"router": "topk", "aux_loss_weight": 0.01, "shared_experts": 1},
    "switch": {"router": "switch", "capacity_factor": 1.0, "aux_loss_weight": 0.01, "expert_dropout": 0.1},
}
ARCHS = {"gpt": {}, "llama": {"arch": "llama", "n_kv_heads": 2}}
ETP = {"dp": 2, "ep": 2, "tp": 2, "expert_tp": True}
LAYOUTS = {  # name: (arch, router, parallel)
    "gpt-topk-etp-sp": ("gpt", "topk", ETP),
    "llama-switch-etp-no-sp": ("llama", "switch", {**ETP, "sequence_parallel": False}),
    "gpt-topk-etp-zero1": ("gpt", "topk", {**ETP, "zero": 1}),
    "gpt-topk-no-etp": ("gpt", "topk", {"dp": 2, "ep": 2, "tp": 2}),  # the memory comparison's baseline
    "llama-switch-etp-saved": ("llama", "switch", ETP),
    "llama-switch-dp4-ep4-resumed": ("llama", "switch", {"dp": 4, "ep": 4}),
}


def _spec(token_data, tmp_path, arch: str, router: str, parallel: dict, steps: int = STEPS):
    moe = {"experts": 4, "group": "sequence", **ROUTERS[router]}
    return tiny_spec(token_data, tmp_path, model={**ARCHS[arch], "n_layers": 2, "moe": moe},
                     parallel={**parallel, "device": "cpu"}, train={"steps": steps}, memory={"measure": True})


@pytest.fixture(scope="module")
def runs(token_data, tmp_path_factory):
    """Every job here in one spawn of 4 ranks: name -> (spec, LayoutRun)."""
    tmp = tmp_path_factory.mktemp("etp")
    specs = {name: _spec(token_data, tmp / name, *job) for name, job in LAYOUTS.items()}
    saved = str(tmp / "ckpt")
    checkpoints = [saved if name.endswith("-saved") else None for name in LAYOUTS]
    resumes = [saved if name.endswith("-resumed") else None for name in LAYOUTS]
    done = run_layouts([s.worker_dict() for s in specs.values()], 4, STEPS, checkpoints=checkpoints,
                       resumes=resumes)
    return {name: (specs[name], run) for name, run in zip(LAYOUTS, done, strict=True)}


@pytest.mark.parametrize("name", [n for n in LAYOUTS if not n.endswith(("-saved", "-resumed"))])
def test_expert_tp_layout_matches_single_process_reference(name, runs, token_data, tmp_path):
    arch, router, _ = LAYOUTS[name]
    losses, norms = reference_run(_spec(token_data, tmp_path, arch, router, {}), STEPS)
    assert runs[name][1].losses == pytest.approx(losses, rel=1e-4)
    assert runs[name][1].grad_norms == pytest.approx(norms, rel=1e-4)


def test_expert_tp_checkpoint_resumes_at_ep4_on_the_reference_curve(runs, token_data, tmp_path):
    losses, norms = reference_run(_spec(token_data, tmp_path, "llama", "switch", {}, 2 * STEPS), 2 * STEPS)
    saved, resumed = runs["llama-switch-etp-saved"][1], runs["llama-switch-dp4-ep4-resumed"][1]
    assert saved.losses + resumed.losses == pytest.approx(losses, rel=1e-4)
    assert saved.grad_norms + resumed.grad_norms == pytest.approx(norms, rel=1e-4)


def test_expert_tp_halves_each_ranks_expert_bytes_as_the_planner_says(runs):
    """Measured fp32 parameter bytes: the routed experts' share halves (E/ep experts of 2·d·h weights per MoE
    layer, GPT), everything else is the same layout's; the planner's per-rank params follow both."""
    spec, on = runs["gpt-topk-etp-sp"]
    _, off = runs["gpt-topk-no-etp"]
    m = spec.model
    experts = m.n_layers * (m.moe.experts // spec.parallel.ep) * 2 * m.d_model * (m.moe.d_expert or m.ffn_dim) * 4
    for rank in range(4):
        assert off.memory[rank]["params"] - on.memory[rank]["params"] == experts // 2
        for layout, run in ((spec, on), (runs["gpt-topk-no-etp"][0], off)):
            assert estimate_rank(layout, rank).params * 4 == run.memory[rank]["params"]
