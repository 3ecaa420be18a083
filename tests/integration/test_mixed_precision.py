"""bf16 through FSDP2's mixed-precision policy (``precision.policy: fsdp``), on the Ray-free harness.

The reference (``tests/support/reference.py::reference_bf16_fsdp``) writes the policy out by hand, with no FSDP:
bf16 copies of the fp32 weights compute each data-parallel rank's microbatches, their gradients are summed in
float32, averaged, clipped, and AdamW steps the fp32 weights. The layouts must match it (the bf16 arithmetic is
the same, only float32 sums differ in order), and must differ from the fp32 run, or bf16 never ran. The same
runs check the planner: measured saved activations and model state against ``memory_report`` (no autocast
copies; half-width gathers), and the bytes the collectives sent against ``comm_model`` (bf16 all-gathers).
"""

from __future__ import annotations

import pytest

from orchestrator.planning.memory_report import MeasuredMemory
from tests.support.comm import compare
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts
from tests.support.reference import reference_bf16_fsdp, reference_run

STEPS = 3
LLAMA = {"arch": "llama", "n_kv_heads": 2}
# world size -> name -> (parallel, model, microbatches)
LAYOUTS = {
    2: {"gpt-dp2-zero3": ({"dp": 2, "zero": 3}, {}, 2), "llama-dp2-zero2": ({"dp": 2, "zero": 2}, LLAMA, 1)},
    4: {"gpt-pp2-dp2-zero3": ({"pp": 2, "dp": 2, "zero": 3}, {}, 2)},
}


def _spec(token_data, tmp_path, parallel: dict, model: dict, microbatches: int, **precision):
    return tiny_spec(token_data, tmp_path, parallel={**parallel, "device": "cpu"}, model=model,
                     train={"steps": STEPS, "microbatches": microbatches},
                     precision={"dtype": "bf16", "policy": "fsdp", **precision},
                     memory={"measure": True}, metrics={"comm_bytes": True})


@pytest.mark.parametrize("world", list(LAYOUTS))
def test_fsdp_bf16_policy_matches_the_hand_written_policy_and_the_planner(world, token_data, tmp_path):
    specs = {name: _spec(token_data, tmp_path / name, *layout) for name, layout in LAYOUTS[world].items()}
    runs = run_layouts([s.worker_dict() for s in specs.values()], world, STEPS)
    for (name, spec), run in zip(specs.items(), runs, strict=True):
        losses, norms = reference_bf16_fsdp(spec, STEPS)
        assert run.losses == pytest.approx(losses, rel=1e-5), name
        assert run.grad_norms == pytest.approx(norms, rel=1e-4), name
        fp32 = spec.model_copy(update={"precision": spec.precision.model_copy(update={"dtype": "fp32",
                                                                                      "policy": "auto"})})
        fp32_norms = reference_run(fp32, STEPS)[1]
        assert max(abs(a / b - 1) for a, b in zip(run.grad_norms, fp32_norms)) > 5e-4, f"{name}: bf16 never ran"
        _assert_planner_matches(name, spec, run)


def _assert_planner_matches(name, spec, run) -> None:
    """Saved activations and model state as the memory model predicts them (the probe sees what autograd keeps,
    exact on these layouts), and bytes per mesh dimension as the communication model does (within 5%)."""
    memory = MeasuredMemory(spec)
    memory.observe([{"rank": rank, "memory": steps[-1]["memory"]} for rank, steps in run.results.items()])
    for rank, row in memory.summary().items():
        err = row["relative_error"]
        assert abs(err["model_state"]) <= 0.01 and abs(err["activations"]) <= 0.02, (name, rank, err)
    for rank, dims in compare(spec, run.field("comm_bytes")).items():
        for dim, (want, got) in dims.items():
            assert want == pytest.approx(got, rel=0.05), (name, rank, dim)
