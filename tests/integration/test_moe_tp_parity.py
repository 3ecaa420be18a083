"""MoE layers under tensor parallelism reproduce the single-process reference (fp32, CPU, 1e-4 relative).

The MoE feed-forward is replicated over the tp ranks (``workers.parallel.gpt_parallel.moe_style``) while attention
and the dense blocks are Megatron-split; with sequence parallelism its input is gathered from the sequence
shards and its output cut back. Checked without Ray (tests/support/parity_harness.py): tp=2 with and without
sequence parallelism on both families, dp=4 x ep=2 x tp=2 (world 8: ep borrows its ranks from dp), for the
topk and switch routers (switch with capacity_factor 1.0, so tokens really drop, and expert dropout), and
dp=2 x pp=2 x tp=2 with and without ep=2 (topk). The model is tiny (2 layers, d_model 32, 4 experts, routing
groups per sequence); each spawn trains all of its jobs (``run_layouts``), so a later job also checks that a
process re-joining a group computes on the new group's meshes (``process_group.forget_previous_meshes``).
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts
from tests.support.reference import reference_run

STEPS = 3
ROUTERS = {
    "topk": {"router": "topk", "aux_loss_weight": 0.01, "shared_experts": 1},
    # expert dropout keyed by token stream position (workers.model.moe.keyed_dropout): the same on any layout
    "switch": {"router": "switch", "capacity_factor": 1.0, "aux_loss_weight": 0.01, "z_loss_weight": 0.001,
               "expert_dropout": 0.1},
}
ARCHS = {"gpt": {}, "llama": {"arch": "llama", "n_kv_heads": 2}}
TP2 = {  # name: (arch, router, parallel), on 2 ranks
    "gpt-topk-tp2-sp": ("gpt", "topk", {"tp": 2}),
    "gpt-switch-tp2-no-sp": ("gpt", "switch", {"tp": 2, "sequence_parallel": False}),
    "llama-switch-tp2-sp": ("llama", "switch", {"tp": 2}),
    "llama-topk-tp2-no-sp": ("llama", "topk", {"tp": 2, "sequence_parallel": False}),
}
WORLD8 = {  # on 8 ranks
    "gpt-topk-dp4-ep2-tp2": ("gpt", "topk", {"dp": 4, "ep": 2, "tp": 2}),
    "llama-switch-dp4-ep2-tp2": ("llama", "switch", {"dp": 4, "ep": 2, "tp": 2}),
    # after the jobs above in the same processes: the pp schedule's first step used to meet their stale meshes
    "gpt-topk-dp2-ep2-pp2-tp2": ("gpt", "topk", {"dp": 2, "ep": 2, "pp": 2, "tp": 2}),
    "llama-topk-dp2-pp2-tp2": ("llama", "topk", {"dp": 2, "pp": 2, "tp": 2}),
}


def _spec(token_data, tmp_path, arch: str, router: str, parallel: dict):
    moe = {"experts": 4, "group": "sequence", **ROUTERS[router]}
    return tiny_spec(token_data, tmp_path, model={**ARCHS[arch], "n_layers": 2, "moe": moe},
                     parallel={**parallel, "device": "cpu"}, train={"steps": STEPS})


def _reference(token_data, tmp_path, name: str, arch: str, router: str, steps: int = STEPS):
    spec = _spec(token_data, tmp_path / f"ref-{name}", arch, router, {})
    return reference_run(spec.with_overrides([f"train.steps={steps}"]), steps)


def _check(token_data, tmp_path, layouts: dict, world: int, checkpoints=None, resumes=None) -> dict:
    """Train ``layouts`` in one spawn of ``world`` ranks; each but those resuming matches its reference."""
    specs = [_spec(token_data, tmp_path / name, *job).worker_dict() for name, job in layouts.items()]
    runs = dict(zip(layouts, run_layouts(specs, world, STEPS, checkpoints=checkpoints, resumes=resumes)))
    for i, (name, (arch, router, _)) in enumerate(layouts.items()):
        if resumes is None or resumes[i] is None:
            losses, norms = _reference(token_data, tmp_path, name, arch, router)
            assert runs[name].losses == pytest.approx(losses, rel=1e-4), name
            assert runs[name].grad_norms == pytest.approx(norms, rel=1e-4), name
    return runs


def test_moe_tp2_with_and_without_sequence_parallelism_matches_single_process(token_data, tmp_path):
    """Also: the tp=2 switch run's checkpoint (replicated MoE weights) resumes at dp=2 under ZeRO-1 on the
    reference curve, expert dropout included."""
    layouts = {**TP2, "resumed-dp2-zero1": ("gpt", "switch", {"dp": 2, "zero": 1})}
    saved = str(tmp_path / "ckpt")
    checkpoints = [saved if name == "gpt-switch-tp2-no-sp" else None for name in layouts]
    resumes = [saved if name == "resumed-dp2-zero1" else None for name in layouts]
    runs = _check(token_data, tmp_path, layouts, 2, checkpoints, resumes)
    losses, norms = _reference(token_data, tmp_path, "resumed", "gpt", "switch", 2 * STEPS)
    both = (runs["gpt-switch-tp2-no-sp"], runs["resumed-dp2-zero1"])
    assert both[0].losses + both[1].losses == pytest.approx(losses, rel=1e-4)
    assert both[0].grad_norms + both[1].grad_norms == pytest.approx(norms, rel=1e-4)


def test_moe_dp4_ep2_tp2_matches_single_process(token_data, tmp_path):
    _check(token_data, tmp_path, WORLD8, 8)
