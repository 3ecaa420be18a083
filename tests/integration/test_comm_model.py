"""The communication model's bytes against the bytes counted, on every parity layout (Ray-free harness).

Each layout trains 2 steps of the tiny GPT with ``metrics.comm_bytes: true``; the counter
(``workers.diagnostics.comm_bytes``) adds up, per mesh dimension, what every collective the step issued sends
under ring accounting. ``layout_search.predicted_bytes`` must be within 5% of it for every rank and every
dimension (zero predicted must be zero measured). One spawn per world size (``run_layouts``) keeps it cheap.
"""

from __future__ import annotations

import pytest

from tests.support.comm import compare
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts

STEPS = 2  # the last is compared: a pipelined tp layout moves extra tp bytes in its first step (one-off set-up)
# world size -> {layout name: parallel fields}; the parity layouts tests/integration/test_parity*.py use
LAYOUTS = {
    2: {"dp2-zero0": {"dp": 2}, "dp2-zero1": {"dp": 2, "zero": 1}, "dp2-zero2": {"dp": 2, "zero": 2},
        "dp2-zero3": {"dp": 2, "zero": 3}, "tp2": {"tp": 2}, "pp2": {"pp": 2}},
    4: {"pp2-dp2": {"pp": 2, "dp": 2}, "tp2-dp2": {"tp": 2, "dp": 2}, "cp2-dp2": {"cp": 2, "dp": 2},
        "pp2-dp2-zero3": {"pp": 2, "dp": 2, "zero": 3},
        # each cp_impl priced by its own exchange (comm_model.cp_bytes), not all as the ring
        "cp4-allgather": {"cp": 4, "cp_impl": "allgather"}, "cp4-ulysses": {"cp": 4, "cp_impl": "ulysses"},
        "cp4-ring": {"cp": 4, "cp_impl": "ring"}},
    8: {"pp2-tp2-dp2": {"pp": 2, "tp": 2, "dp": 2}},
}


@pytest.mark.parametrize("world", list(LAYOUTS))
def test_predicted_bytes_are_the_measured_bytes(world, token_data, tmp_path):
    specs = {name: tiny_spec(token_data, tmp_path / name, parallel={**fields, "device": "cpu"},
                             train={"steps": STEPS}, metrics={"comm_bytes": True})
             for name, fields in LAYOUTS[world].items()}
    runs = run_layouts([s.worker_dict() for s in specs.values()], world, STEPS)
    failures = []
    for (name, spec), run in zip(specs.items(), runs, strict=True):
        for rank, dims in compare(spec, run.field("comm_bytes")).items():
            for dim, (want, got) in sorted(dims.items()):
                print(name, rank, dim, int(want), got)  # -s shows the table the README quotes
                if want != pytest.approx(got, rel=0.05):
                    failures.append((name, rank, dim, want, got))
    assert not failures
