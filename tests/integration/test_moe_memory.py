"""The planner's MoE activations and in-step peak against what ranks measure (Ray-free harness, 2 ranks).

Each job trains 2 steps of the tiny MoE GPT or Llama with ``memory.measure: true`` (see
tests/integration/test_memory_in_step.py for what the probe counts). The prediction counts each MoE layer's
router tensors, routed token copies, expert hidden activations and combine (``moe_terms.moe_activation_bytes``)
in place of a dense feed-forward; it must be within 10% of the measured saved activations and step peak, as
the dense planner tests require. The layouts route without drops (capacity_factor 2.0: with drops the estimate
is the capacity's upper bound) and cover expert parallelism under ZeRO-1, tensor parallelism with and without
sequence parallelism, bf16, expert dropout, shared experts, noisy top-k with the z-loss, and expert choice under ZeRO-3.
"""

from __future__ import annotations

from orchestrator.planning.estimate import autocast_copy_bytes, estimate_rank
from orchestrator.planning.memory_report import probe_visible_peak
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts

LAYOUTS = {  # name: (model, parallel, train, dtype)
    "gpt-topk-dp2-ep2-zero1": ({"moe": {"experts": 4, "router": "topk", "top_k": 2, "shared_experts": 1}},
                               {"dp": 2, "ep": 2, "zero": 1}, {}, "fp32"),
    "llama-switch-tp2-bf16": ({"arch": "llama", "n_kv_heads": 2,
                               "moe": {"experts": 4, "router": "switch", "capacity_factor": 2.0,
                                       "expert_dropout": 0.1}},
                              {"tp": 2}, {}, "bf16"),
    "gpt-noisy-tp2-no-sp": ({"moe": {"experts": 4, "router": "noisy_topk", "z_loss_weight": 0.001}},
                            {"tp": 2, "sequence_parallel": False}, {}, "fp32"),
    "gpt-expert-choice-dp2-zero3-mb4": ({"moe": {"experts": 4, "router": "expert_choice", "every": 2}},
                                        {"dp": 2, "zero": 3}, {"microbatches": 4}, "fp32"),
}


def test_predicted_moe_activations_and_peak_are_the_measured_ones(token_data, tmp_path):
    specs = {name: tiny_spec(token_data, tmp_path / name, model={"n_layers": 2, **model},
                             parallel={**parallel, "device": "cpu"}, train={"steps": 2, **train},
                             memory={"measure": True}, precision={"dtype": dtype})
             for name, (model, parallel, train, dtype) in LAYOUTS.items()}
    runs = run_layouts([s.worker_dict() for s in specs.values()], 2, 2)
    for (name, spec), run in zip(specs.items(), runs, strict=True):
        assert sorted(run.memory) == [0, 1]
        for rank, measured in run.memory.items():
            e = estimate_rank(spec, rank)
            saved = e.activation_bytes + autocast_copy_bytes(spec, e.params)  # the probe sees autocast's copies
            errors = ((saved - measured["activations"]) / measured["activations"],
                      (probe_visible_peak(spec, e) - measured["step_peak"]) / measured["step_peak"])
            print(name, rank, measured["activations"], saved, measured["step_peak"], probe_visible_peak(spec, e),
                  [f"{err:+.3f}" for err in errors])
            assert all(abs(err) <= 0.10 for err in errors), (name, rank, errors, measured, e.as_dict())
