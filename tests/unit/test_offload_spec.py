"""memory.offload, activation_compression and the new optimizer names: bad combinations refused with the fix."""

from __future__ import annotations

import pytest

from orchestrator import JobSpec
from orchestrator.errors import SpecError
from orchestrator.planning.disk_check import check_offload_space, offload_bytes
from orchestrator.planning.estimate import estimate


def _spec(tmp_path, **sections):
    raw = {"data": {"path": str(tmp_path)}, **sections}
    return JobSpec.from_dict(raw)


@pytest.mark.parametrize("sections, field, fix", [
    ({"memory": {"offload": {"optimizer": True, "tier": "nvme"}}}, "memory.offload.path", "set memory.offload.path"),
    ({"memory": {"offload": {"path": "/x"}}}, "memory.offload.path", "tier: nvme"),
    ({"memory": {"offload": {"optimizer": True}}, "optim": {"name": "sgd"}}, "memory.offload.optimizer", "adamw"),
    ({"optim": {"name": "adafactor", "implementation": "foreach"}, "parallel": {"dp": 2, "zero": 3}},
     "optim.implementation", "auto or for_loop"),
    ({"memory": {"offload": {"params": True}}, "parallel": {"dp": 2, "zero": 3}}, "memory.offload.params",
     "memory.offload.optimizer: true"),
    ({"memory": {"offload": {"params": True, "optimizer": True}}, "parallel": {"dp": 2, "zero": 2}},
     "parallel.zero", "parallel.zero: 3"),
    ({"memory": {"activation_compression": "int4"}}, "memory.activation_compression", "bf16"),
])
def test_refused_with_field_and_fix(tmp_path, sections, field, fix):
    with pytest.raises(SpecError) as info:
        _spec(tmp_path, **sections)
    assert info.value.field == field and fix in str(info.value)


def test_accepted_combinations_reach_the_workers(tmp_path):
    spec = _spec(tmp_path, optim={"name": "paged_adamw"}, parallel={"dp": 2, "zero": 3},
                 memory={"offload": {"optimizer": True, "activations": True, "tier": "nvme", "path": str(tmp_path),
                                     "prefetch": 3}, "activation_compression": "fp8"})
    memory = spec.worker_dict()["memory"]
    assert memory["offload"]["prefetch"] == 3 and memory["activation_compression"] == "fp8"


def test_running_out_of_disk_is_an_error_before_start(tmp_path):
    small = {"optimizer": True, "tier": "nvme", "path": str(tmp_path / "new" / "dir")}
    spec = _spec(tmp_path, memory={"offload": small})
    assert offload_bytes(spec) > 0
    check_offload_space(spec)  # a tiny model fits
    huge = _spec(tmp_path, memory={"offload": small}, model={"d_model": 16384, "n_heads": 64, "n_layers": 400})
    with pytest.raises(SpecError) as info:
        check_offload_space(huge)
    assert info.value.field == "memory.offload.path" and "GiB free" in str(info.value)
    assert "tier: cpu" in str(info.value)
    assert offload_bytes(_spec(tmp_path, memory={"offload": {"optimizer": True}})) == 0  # host tier: no files
    # parameter offload adds the fp32 parameter shard: 4 bytes a parameter
    both = _spec(tmp_path, parallel={"zero": 3}, memory={"offload": {**small, "params": True}})
    assert offload_bytes(both) == offload_bytes(spec) + 4 * estimate(spec)[0].params


@pytest.mark.parametrize("device, zero, per_param", [("cpu", 0, 8), ("cuda", 0, 12), ("cuda", 3, 12 / 2)])
def test_disk_check_counts_what_the_planner_offloads(tmp_path, device, zero, per_param):
    """One source for offloaded bytes: the planner's (moments, plus a host fp32 master for GPU parameters)."""
    from orchestrator.planning.estimate import estimate

    nvme = {"optimizer": True, "tier": "nvme", "path": str(tmp_path)}
    spec = _spec(tmp_path, memory={"offload": nvme}, parallel={"dp": 2, "zero": zero, "device": device})
    rows = estimate(spec)
    assert [r.state.offloaded for r in rows] == [int(per_param * r.params) for r in rows]
    assert offload_bytes(spec) == sum(r.state.offloaded for r in rows)


def test_disk_check_counts_the_activations_that_leave_the_device(tmp_path):
    """Activation offload keeps about two layers on the device; the rest of what is saved goes to the files."""
    from orchestrator.planning.estimate import estimate

    nvme = {"activations": True, "tier": "nvme", "path": str(tmp_path)}
    spec = _spec(tmp_path, memory={"offload": nvme, "activation_compression": "bf16"})
    plain = estimate(_spec(tmp_path))
    rows = estimate(spec)
    for row, base in zip(rows, plain):
        assert row.offloaded_activation_bytes > row.activation_bytes  # most of it leaves
        assert row.offloaded_activation_bytes + row.activation_bytes == base.activation_bytes
    assert offload_bytes(spec) == sum(r.offloaded_activation_bytes // 2 for r in rows)


@pytest.mark.parametrize("parallel", [{}, {"pp": 2}])
def test_activation_offload_plans_a_document_masked_step_as_a_causal_one(tmp_path, parallel):
    """Under ``model.attention_mask: document`` attention runs blockwise and saves no mask (docs/guides/attention.md),
    so with activation offload the plan keeps and offloads exactly what it does for causal attention."""
    memory = {"offload": {"activations": True}}
    model = {"seq_len": 512, "n_layers": 4}
    train = {"microbatches": 4}
    causal = _spec(tmp_path, model=model, memory=memory, parallel=parallel, train=train)
    masked = _spec(tmp_path, model={**model, "attention_mask": "document"}, memory=memory, parallel=parallel,
                   train=train)
    for c, m in zip(estimate(causal), estimate(masked)):
        assert m.activation_bytes == c.activation_bytes
        assert m.offloaded_activation_bytes == c.offloaded_activation_bytes
