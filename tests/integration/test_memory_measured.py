"""On real runs of the example GPT, the memory model predicts what each rank measures.

Each layout trains 2 steps with ``memory.measure: true`` (its ranks spawned without Ray, one Ray job checks the
summary the controller writes): every rank counts the
local tensor bytes of its parameters, gradients and optimizer state after the
optimizer step, and the peak bytes saved for backward over the step. The
prediction comes from the planner alone (no torch). Model state must be within
10% and activations within 25% on every rank.
"""

from __future__ import annotations

import logging

import pytest

from orchestrator import TrainingJob
from orchestrator.planning.memory_report import MeasuredMemory
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped

LAYOUTS = {
    "dp2-zero0-bf16": ({"dp": 2, "zero": 0}, "none"),
    "dp2-zero1": ({"dp": 2, "zero": 1}, "none"),
    "dp2-zero2-selective": ({"dp": 2, "zero": 2}, "selective"),
    "dp2-zero3-full": ({"dp": 2, "zero": 3}, "full"),
    "pp2-1f1b": ({"pp": 2, "pp_schedule": "1f1b"}, "none"),
    "pp2-interleaved-full": ({"pp": 2, "pp_schedule": "interleaved_1f1b"}, "full"),
    "tp2-sp": ({"tp": 2}, "none"),
    "tp2-no-sp-zero2": ({"tp": 2, "dp": 2, "zero": 2, "sequence_parallel": False}, "none"),
}


# frozen bases: no gradients or optimizer state; NF4 bases at ~0.516 bytes a weight, sharded by tp (widths 64·tp)
WIDE = {"d_model": 128, "n_heads": 4, "d_ff": 128, "n_layers": 2}
LORA_LAYOUTS = {
    "lora-tp2-pp2": ({"tp": 2, "pp": 2}, {"lora": {"rank": 4, "targets": ["wq", "wo", "w1", "w2", "output"]}}),
    "qlora-tp2-dp2-zero3": ({"tp": 2, "dp": 2, "zero": 3}, {**WIDE, "lora": {"rank": 4, "quantize": "nf4"}}),
}


def _spec(name: str, token_data, tmp_path):
    """The layout's 2-step job with ``memory.measure`` on."""
    if name in LORA_LAYOUTS:
        parallel, model = LORA_LAYOUTS[name]
        return tiny_spec(token_data, tmp_path, parallel={**parallel, "device": "cpu"}, model=model,
                         memory={"measure": True}, train={"steps": 2}, checkpoint={"memory_every": 0})
    parallel, recompute = LAYOUTS[name]
    return tiny_spec(token_data, tmp_path, parallel={**parallel, "device": "cpu"},
                     memory={"recompute": recompute, "measure": True}, train={"steps": 2},
                     checkpoint={"memory_every": 0}, precision={"dtype": "bf16" if "bf16" in name else "fp32"})


@pytest.fixture(scope="module")
def specs(token_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memory-measured")
    return {name: _spec(name, token_data, tmp / name) for name in [*LAYOUTS, *LORA_LAYOUTS]}


@pytest.fixture(scope="module")
def runs(specs):
    """Every layout's ranks without Ray (tests/support/parity_harness.py), those of one size in one spawn: what
    each rank measures is the trainer's; the controller's part, pairing it with the planner, is
    ``MeasuredMemory``, applied here as the controller applies it (and through Ray below)."""
    return run_grouped(specs)


def _measured(spec, run) -> dict[int, dict]:
    """The summary's ``memory``: each rank's last step's measured bytes beside the planner's prediction."""
    memory = MeasuredMemory(spec)
    memory.observe([steps[-1] for steps in run.results.values()])
    return memory.summary()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_prediction_matches_measured_bytes(name, specs, runs):
    check_measured(name, specs[name], _measured(specs[name], ran(runs, name)))


@pytest.mark.parametrize("name", list(LORA_LAYOUTS))
def test_lora_prediction_matches_measured_bytes(name, specs, runs):
    # frozen bases save only what the adapters' gradients need
    check_measured(name, specs[name], _measured(specs[name], ran(runs, name)), activation_limit=0.10)


def test_a_ray_job_reports_the_measured_and_predicted_bytes_in_its_summary(ray_cluster, token_data, tmp_path):
    spec = _spec("dp2-zero3-full", token_data, tmp_path)
    check_measured("dp2-zero3-full", spec, TrainingJob(spec, progress=False).run().memory)


def check_measured(name, spec, memory: dict[int, dict], activation_limit: float = 0.25):
    assert sorted(memory) == list(range(spec.parallel.world_size))
    for rank, row in memory.items():
        err = row["relative_error"]
        print(name, rank, {k: f"{v:+.3f}" for k, v in err.items()})
        assert abs(err["model_state"]) <= 0.10, (rank, row)
        assert abs(err["activations"]) <= activation_limit, (rank, row)


def test_run_warns_before_start_when_the_layout_will_not_fit(ray_cluster, token_data, tmp_path):
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("raymesh").addHandler(handler)
    try:
        spec = tiny_spec(token_data, tmp_path, parallel={"dp": 2, "device": "cpu", "device_memory": "100KB"},
                         train={"steps": 1}, checkpoint={"memory_every": 0})
        TrainingJob(spec, progress=False).run()
    finally:
        logging.getLogger("raymesh").removeHandler(handler)
    names = [line.split()[0] for line in lines]
    warning = lines[names.index("event=memory_warning")]
    assert "rank 0 needs" in warning and "of 100.00 KB" in warning and "fix=" in warning
    assert names.index("event=memory_warning") < names.index("event=control") < names.index("event=layout")
