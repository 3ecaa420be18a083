"""Every parallel layout reproduces the single-process reference's losses (fp32, CPU, 1e-4 relative)."""

from __future__ import annotations

import pytest

from orchestrator import TrainingJob
from tests.support.jobs import tiny_spec
from tests.support.reference import reference_run

STEPS = 10

LAYOUTS = {
    "dp4": {"dp": 4},
    "tp2-dp2": {"tp": 2, "dp": 2},
    "tp2-no-sp": {"tp": 2, "sequence_parallel": False},
    "tp2-dp2-zero3": {"tp": 2, "dp": 2, "zero": 3},
    "pp2-dp2-gpipe": {"pp": 2, "dp": 2, "pp_schedule": "gpipe"},
    "pp2-dp2-1f1b": {"pp": 2, "dp": 2, "pp_schedule": "1f1b"},
    "pp2-dp2-interleaved_1f1b": {"pp": 2, "dp": 2, "pp_schedule": "interleaved_1f1b"},
    "pp2-dp2-interleaved_zero_bubble": {"pp": 2, "dp": 2, "pp_schedule": "interleaved_zero_bubble"},
    "pp2-dp2-zbv": {"pp": 2, "dp": 2, "pp_schedule": "zbv"},
    "pp2-dp2-dualpipev": {"pp": 2, "dp": 2, "pp_schedule": "dualpipev"},
    "pp2-tp2-dp2": {"pp": 2, "tp": 2, "dp": 2},
    "dp2-zero1": {"dp": 2, "zero": 1},
    "dp2-zero2": {"dp": 2, "zero": 2},
    "dp4-zero3": {"dp": 4, "zero": 3},
    "pp2-dp2-zero3-interleaved": {"pp": 2, "dp": 2, "zero": 3, "pp_schedule": "interleaved_1f1b"},
}


@pytest.fixture(scope="module")
def reference(token_data, tmp_path_factory):
    return reference_run(tiny_spec(token_data, tmp_path_factory.mktemp("ref")), STEPS)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process_reference(name, reference, ray_cluster, token_data, tmp_path):
    parallel = {**LAYOUTS[name], "device": "cpu"}
    train = {"microbatches": 4} if parallel.get("pp_schedule") == "dualpipev" else {}
    spec = tiny_spec(token_data, tmp_path, parallel=parallel, train=train)
    result = TrainingJob(spec, progress=False).run()
    assert len(result.losses) == STEPS
    losses, grad_norms = reference
    assert result.losses == pytest.approx(losses, rel=1e-4)
    assert result.grad_norms == pytest.approx(grad_norms, rel=1e-4)  # the global norm that clipping uses
    assert result.layout["world_size"] == spec.parallel.world_size
    assert set(result.peak_memory_bytes) == set(range(spec.parallel.world_size))
