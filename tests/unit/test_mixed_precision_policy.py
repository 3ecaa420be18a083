"""``precision.policy`` / ``reduce_dtype``: what the spec refuses, how the policy resolves, and what the planner
prices under FSDP2's bf16 policy (the runs themselves: tests/integration/test_mixed_precision.py)."""

from __future__ import annotations

import pytest

from orchestrator import JobSpec
from orchestrator.planning import estimate as est
from orchestrator.planning.layout_search import Evaluator, Shape, layout_of, predicted_bytes
from orchestrator.units import parse_bytes
from tests.support.spec_errors import assert_actionable, spec_error
from workers.contract.mixed_precision import uses_fsdp_mixed


def job(**sections) -> dict:
    return {"data": {"path": "data/tiny"}, **sections}


MODEL = {"d_model": 256, "n_layers": 4, "n_heads": 4, "d_ff": 1024, "seq_len": 512}


def _spec(device: str = "auto", **precision) -> JobSpec:
    return JobSpec.from_dict(job(model=MODEL, parallel={"dp": 4, "zero": 3, "device": device},
                                 precision={"dtype": "bf16", **precision}, train={"global_batch_size": 16}))


@pytest.mark.parametrize("parallel, precision, field, value, fix", [
    ({"dp": 2, "zero": 3}, {"dtype": "fp16", "policy": "fsdp"}, "precision.policy", "fsdp", "precision.dtype: bf16"),
    ({"dp": 2, "zero": 1}, {"dtype": "bf16", "policy": "fsdp"}, "precision.policy", "fsdp", "parallel.zero: 2 or 3"),
    ({"dp": 2, "zero": 3, "dp_sync": "ps"}, {"dtype": "bf16", "policy": "fsdp"}, "precision.policy", "fsdp",
     "dp_sync: allreduce"),
    ({"dp": 2}, {"policy": "autocast"}, "precision.policy", "autocast", "precision.dtype: bf16"),
    ({"dp": 2, "zero": 3, "device": "cpu"}, {"dtype": "bf16", "reduce_dtype": "bf16"}, "precision.reduce_dtype",
     "bf16", "precision.policy: fsdp"),
    ({"dp": 2, "zero": 0}, {"dtype": "bf16", "policy": "fsdp", "reduce_dtype": "bf16"}, "precision.policy",
     "fsdp", "parallel.zero: 2 or 3"),
])
def test_a_policy_that_cannot_take_effect_is_refused(parallel, precision, field, value, fix):
    assert_actionable(spec_error(job(parallel=parallel, precision=precision)), field, value, fix)


def test_policy_resolves_to_fsdp_on_a_gpu_and_autocast_on_the_cpu_unless_asked():
    assert uses_fsdp_mixed("bf16", "auto", 3, "allreduce", on_cuda=True)
    assert not uses_fsdp_mixed("bf16", "auto", 3, "allreduce", on_cuda=False)
    assert uses_fsdp_mixed("bf16", "fsdp", 2, "allreduce", on_cuda=False)
    assert not uses_fsdp_mixed("bf16", "autocast", 3, "allreduce", on_cuda=True)
    assert not uses_fsdp_mixed("bf16", "auto", 1, "allreduce", on_cuda=True)  # ZeRO-1: no FSDP2 units
    assert not uses_fsdp_mixed("fp16", "auto", 3, "allreduce", on_cuda=True)
    assert est.fsdp_mixed(_spec("auto")) and est.fsdp_mixed(_spec("cpu", policy="fsdp"))
    assert not est.fsdp_mixed(_spec("cpu")) and not est.fsdp_mixed(_spec("auto", policy="autocast"))


def test_planner_prices_bf16_gathers_and_no_autocast_copies_under_the_fsdp_policy():
    mixed, autocast = est.estimate_rank(_spec(), 0), est.estimate_rank(_spec(policy="autocast"), 0)
    assert mixed.state.params == autocast.state.params and mixed.state.optimizer == autocast.state.optimizer
    assert mixed.state.gathered * 2 == autocast.state.gathered  # bf16 copies of the same gathered units
    assert est.autocast_copy_bytes(_spec(), mixed.params) == 0 < est.autocast_copy_bytes(
        _spec(policy="autocast"), autocast.params)
    assert mixed.activation_bytes < autocast.activation_bytes  # bf16 residual stream, one copy per norm output
    # the layout search prices the job's own layout as the estimate does, on both policies; fp16 (loss scaling,
    # so autocast) is never priced as the FSDP2 policy, also on a GPU with ZeRO-3
    fp16 = _spec(dtype="fp16")
    assert not est.fsdp_mixed(fp16) and not Shape.of(fp16).fsdp_mixed(3)
    for spec in (_spec(), _spec(policy="autocast"), fp16):
        peak, _ = Evaluator(Shape.of(spec), parse_bytes("80GB")).peak(layout_of(spec))
        assert peak == pytest.approx(est.estimate_rank(spec, 0).total_bytes, rel=0.05)


def test_comm_model_gathers_bf16_and_reduces_in_the_reduce_dtype():
    fp32_reduce = predicted_bytes(_spec())[0]["dp"]
    bf16_reduce = predicted_bytes(_spec(reduce_dtype="bf16"))[0]["dp"]
    autocast = predicted_bytes(_spec(policy="autocast"))[0]["dp"]
    # ZeRO-3, one microbatch: a reduce-scatter of the gradients and two gathers of the parameters, each moving
    # the same elements: 3 fp32 tensors, or 1 fp32 + 2 bf16, or 3 bf16
    assert autocast == pytest.approx(fp32_reduce * 3 / 2) and bf16_reduce == pytest.approx(autocast / 2)
