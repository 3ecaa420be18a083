"""MoE layers train the same at dp=2 as single-process (fp32, CPU, 1e-4), for every router, drops included.

``group: sequence`` makes capacity, drops and auxiliary losses per sequence and the routing noise a function
of the sequence's stream position, so splitting the batch over ranks and microbatches changes nothing. Runs
through the Ray-free harness (tests/support/parity_harness.py): the real Trainer, DDP over gloo; all cases
share one pair of spawned ranks (``run_layouts``) to pay for spawning once.
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts
from tests.support.reference import reference_run

STEPS = 3
# every router, each with its paper's knobs on; capacity_factor 1.0 so switch and gshard really drop tokens
ROUTERS = {
    "topk": {"router": "topk", "bias_balancing": True, "bias_update_rate": 0.01, "shared_experts": 1},
    "noisy_topk": {"router": "noisy_topk"},
    "gshard": {"router": "gshard", "capacity_factor": 1.0},
    "switch": {"router": "switch", "capacity_factor": 1.0, "z_loss_weight": 0.001},
    "expert_choice": {"router": "expert_choice", "capacity_factor": 2.0},
}
ARCHS = {"gpt": {}, "llama": {"arch": "llama", "n_kv_heads": 2}}
# every router on the GPT; the Llama (SwiGLU experts) with a dropless and a dropping router
CASES = [(arch, router) for router in ROUTERS for arch in ARCHS if arch == "gpt" or router in ("gshard", "topk")]


def test_moe_dp2_matches_single_process_for_every_router(token_data, tmp_path):
    specs = {}
    for arch, router in CASES:
        moe = {"experts": 4, "every": 2, "aux_loss_weight": 0.01, "group": "sequence", **ROUTERS[router]}
        specs[arch, router] = tiny_spec(token_data, tmp_path / f"{arch}-{router}", parallel={"dp": 2},
                                        model={**ARCHS[arch], "moe": moe}, train={"steps": STEPS})
    runs = run_layouts([s.worker_dict() for s in specs.values()], 2, STEPS)
    for (case, spec), run in zip(specs.items(), runs, strict=True):
        losses, norms = reference_run(spec, STEPS)
        assert run.losses == pytest.approx(losses, rel=1e-4), case
        assert run.grad_norms == pytest.approx(norms, rel=1e-4), case


# under a pipeline the schedule runs several forwards before their backwards, probes each stage's shapes once
# before the first step and recomputes a microbatch long after its forward: each must place its sequences (noise,
# dropout keys) by the schedule's microbatch index, and the probe must not count as a microbatch
PIPELINED = {
    "noisy_topk": ({"router": "noisy_topk"}, "none", "1f1b"),
    "topk-bias-dropout-recompute": ({"router": "topk", "bias_balancing": True, "bias_update_rate": 0.01,
                                     "expert_dropout": 0.1}, "full", "1f1b"),
    "gshard-recompute-gpipe": ({"router": "gshard", "capacity_factor": 1.0}, "full", "gpipe"),
}


def test_moe_pp2_matches_single_process_with_noise_dropout_and_recompute(token_data, tmp_path):
    specs = {}
    for case, (router, recompute, schedule) in PIPELINED.items():
        moe = {"experts": 4, "aux_loss_weight": 0.01, "group": "sequence", **router}
        specs[case] = tiny_spec(token_data, tmp_path / case, parallel={"pp": 2, "pp_schedule": schedule},
                                model={"n_layers": 2, "moe": moe}, memory={"recompute": recompute},
                                train={"steps": STEPS, "microbatches": 4})
    runs = run_layouts([s.worker_dict() for s in specs.values()], 2, STEPS)
    for (case, spec), run in zip(specs.items(), runs, strict=True):
        losses, norms = reference_run(spec, STEPS)
        assert run.losses == pytest.approx(losses, rel=1e-4), case
        assert run.grad_norms == pytest.approx(norms, rel=1e-4), case
