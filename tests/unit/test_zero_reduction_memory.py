"""The planner's in-step peak against every live tensor of a real step (torch's ``MemTracker``, Ray-free
ranks), for ZeRO 0-2 at dp=2 and ZeRO 0-1 on a tp=2 x dp=2 layout, within the 10% the planner is held to.

What it guards: ZeRO-0 and ZeRO-1 reduce through a flat copy of the gradients that exists only after backward
(``ModelState.reducing``). The model used to count ZeRO-0's as ``replicate()``'s unsharded parameter copy, all
step long (the gradient buckets that replaced ``replicate()`` make none): +15.5% here, +18.2% at tp=2; and
ZeRO-1's as one buffer on top of the activations, missing gloo's copy and the gradient slices: -13.1%.
"""

from __future__ import annotations

import pytest

from orchestrator.planning.estimate import estimate_rank
from tests.support.jobs import tiny_spec
from tests.support.step_memory import step_peaks

TOLERANCE = 0.10  # tests/integration/test_memory_in_step.py's bound, README "Planner"


def _specs(token_data, tmp_path, layouts: list[dict]):
    """The tiny GPT at one sequence a rank and one microbatch (``MemTracker`` tracks one forward a step)."""
    return [tiny_spec(token_data, tmp_path / str(i), parallel={**lay, "device": "cpu"},
                      train={"global_batch_size": lay.get("dp", 1), "microbatches": 1})
            for i, lay in enumerate(layouts)]


def _errors(specs, peaks) -> list[tuple]:
    """(layout, rank, measured, predicted, relative error) for every rank of every spec."""
    out = []
    for spec, by_rank in zip(specs, peaks):
        for rank, measured in sorted(by_rank.items()):
            predicted = estimate_rank(spec, rank).total_bytes
            out.append((spec.parallel.zero, spec.parallel.tp, rank, measured, predicted,
                        round((predicted - measured) / measured, 3)))
    return out


@pytest.mark.parametrize("layouts", [
    # not ZeRO-3: FSDP2 regathers each block, and how many gathered blocks live at once depends on when gloo's
    # asynchronous all-gathers end, so its MemTracker peak varies run to run (-7.5% alone, past 10% once in a
    # full unit run); tests/integration/test_memory_in_step.py holds ZeRO-3 to the memory probe
    [{"dp": 2, "zero": z} for z in range(3)],
    [{"dp": 2, "tp": 2, "zero": 0}, {"dp": 2, "tp": 2, "zero": 1}],
], ids=["dp2-zero012", "tp2-dp2-zero01"])
def test_predicted_peak_is_every_live_tensor_of_the_step(layouts, token_data, tmp_path):
    specs = _specs(token_data, tmp_path, layouts)
    errors = _errors(specs, step_peaks(specs))
    assert all(abs(e[-1]) <= TOLERANCE for e in errors), errors
