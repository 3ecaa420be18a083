"""``parallel.grad_reduce_dtype: bf16``: ZeRO 1-3 reduce their gradients in bf16 (ZeRO++'s low-precision
gradients), Ray-free (tests/support/parity_harness.py).

What is stated (docs/guides/hybrid-sharding.md) and checked here: the counted bytes of the reduction halve (the
ZeRO-1 all-gather of fp32 slices does not change), the first step's global gradient norm is within
(n + 1) * 2^-8 of the reference (bf16's unit roundoff per rounding, n ranks summed), and after 200 steps the loss is
within 1% of the fp32 reduction's.
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts
from tests.support.reference import reference_run

LONG = 200
LAYOUTS = {"zero1-dp2": {"dp": 2, "zero": 1}, "zero3-dp4-shard2": {"dp": 4, "dp_shard": 2, "zero": 3}}
UNIT_ROUNDOFF = 2.0 ** -8


def _spec(token_data, tmp_path, parallel: dict, dtype: str, steps: int):
    return tiny_spec(token_data, tmp_path, parallel={"device": "cpu", **parallel, "grad_reduce_dtype": dtype},
                     train={"steps": steps}, metrics={"comm_bytes": True})


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_reduction_halves_its_bytes_within_the_stated_error(name, token_data, tmp_path):
    parallel = LAYOUTS[name]
    world = parallel["dp"]
    specs = [_spec(token_data, tmp_path / dtype, parallel, dtype, 2) for dtype in ("fp32", "bf16")]
    full, low = run_layouts([s.worker_dict() for s in specs], world, 2)
    reference = reference_run(specs[0], 1)
    assert low.grad_norms[0] == pytest.approx(reference[1][0], rel=(world + 1) * UNIT_ROUNDOFF)
    assert low.grad_norms[0] != full.grad_norms[0]  # the reduction did run in bf16
    before, after = full.field("comm_bytes")[0][-1], low.field("comm_bytes")[0][-1]
    if parallel["zero"] == 1:  # reduce-scatter halves, the fp32 all-gather of the slices stays: 3/4 of the row
        assert after["dp"] == pytest.approx(0.75 * before["dp"], rel=0.01)
    else:  # zero 3: each of the 4 gathers stays, the reduce-scatter (1/5 of the row at 2 microbatches) halves
        assert after["dp_shard"] == pytest.approx(0.9 * before["dp_shard"], rel=0.01)
        assert after["dp_replicate"] == pytest.approx(before["dp_replicate"] / 2, rel=0.01)


def test_bf16_reduction_keeps_the_loss_within_1_percent_after_200_steps(token_data, tmp_path):
    specs = [_spec(token_data, tmp_path / dtype, LAYOUTS["zero1-dp2"], dtype, LONG) for dtype in ("fp32", "bf16")]
    full, low = run_layouts([s.worker_dict() for s in specs], 2, LONG, timeout_s=900)
    assert low.losses[-1] == pytest.approx(full.losses[-1], rel=0.01)
    assert low.losses[-1] < 0.8 * low.losses[0]  # it trained
