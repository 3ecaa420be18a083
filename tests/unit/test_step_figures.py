"""Each step figure's reducer: any tree of merges over the ranks' results records what one fold over them does
(the in-band reduction up a tree relies on it), and that record is the one the run records always carried."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from orchestrator.observability.run_records import held_out_loss, step_record
from workers.contract.figures import FIGURES, figure_value, fold, merge_partials, record_entries
from workers.loop.summary import StepSummary
from workers.protocol import StepResult, StepTimes


def _result(rank: int, **extras) -> StepResult:
    return StepResult(rank=rank, step=3, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=8, applied=True,
                      time_s=StepTimes(), peak_memory_bytes=10, current_memory_bytes=5, **extras)


def _ranks(n: int = 7) -> list[StepResult]:
    """Ranks reporting every built-in figure the way real jobs do (some only on some ranks)."""
    out = []
    for r in range(n):
        last = r % 2 == 1  # the last pipeline stage: the held-out loss and the MoE layers of the late blocks
        out.append(_result(
            r, memory={"params": 100 + r, "activations": 7 * r}, timeline=[{"rank": r, "kind": "F", "i": i}
                                                                          for i in range(2)],
            local_steps=r % 3, clock=10 + r % 4, moe={f"layers.{2 * last}": {"balance": 1.0 + last}},
            comm_bytes={"dp": 1000 + r, **({"pp": 50 * r} if last else {})},
            ps={"push": 10 * r, "pull": 3 * r, "staleness": r % 3},
            eval_loss=(0.1 * (r + 1) + 1e-17 * r) if last else None, eval_s=0.5 + 0.1 * r,
            data_mix={"a": 12 + r, "b": 4}, dpo={"reward_accuracy": 0.25 * r}, global_batch=16,
            mtp={"loss": 0.1 * r, "depths": [1.0 / 3 * r]}))
    return out


def _tree(results: list[StepResult], rng: random.Random) -> dict:
    """A random reduction tree: the ranks shuffled, lifted, and merged pairwise in random order."""
    parts = [fold([r]) for r in rng.sample(results, len(results))]
    while len(parts) > 1:
        i = rng.randrange(len(parts) - 1)
        parts[i:i + 2] = [merge_partials(parts[i], parts[i + 1])]
    return parts[0]


def test_every_tree_of_merges_records_what_one_fold_does():
    results = _ranks()
    whole = fold(results)
    rng = random.Random(0)
    for _ in range(20):
        tree = _tree(results, rng)
        assert record_entries(tree) == record_entries(whole)
        assert figure_value(tree, "timeline") == figure_value(whole, "timeline")
        assert figure_value(tree, "memory") == figure_value(whole, "memory")


def test_the_records_are_the_ones_the_old_reduction_over_the_list_made():
    results = _ranks()
    record = step_record(StepSummary.of_all(results), step_s=1.0, tokens=64, end_time=0.0, checkpoint_s=0.0)
    held = [r.eval_loss for r in results if r.eval_loss is not None]
    assert record["eval_loss"] == statistics.fmean(held) and record["eval_s"] == max(r.eval_s for r in results)
    assert record["comm_bytes"] == {"dp": 1006, "pp": 250}
    assert record["ps"] == {"push_bytes": 210, "pull_bytes": 63, "staleness": 2}
    assert record["moe"] == {"layers.0": {"balance": 1.0}, "layers.2": {"balance": 2.0}}
    assert record["data_mix"] == {"a": 12, "b": 4} and record["dpo"] == {"reward_accuracy": 0.0}  # rank 0's
    assert record["mtp"] == {"loss": 0.0, "depths": [0.0]}  # rank 0's (every rank reports the dp-reduced figures)
    assert not {"timeline", "local_steps", "clock"} & set(record)  # read from the fold, not the record
    assert record["memory"]["0"] == {"peak_bytes": 10, "current_bytes": 5}  # the core per-rank memory, as always
    assert [e["rank"] for e in figure_value(fold(results), "timeline")] == [r for r in range(7) for _ in range(2)]


def test_a_mean_is_fmean_bit_for_bit_in_any_order_where_a_float_sum_is_not():
    values = [0.1, 0.2, 0.3, 1e16, -1e16, 0.7, 1 / 3]
    results = [_result(r, eval_loss=v, eval_s=1.0) for r, v in enumerate(values)]
    rng = random.Random(1)
    means = {figure_value(_tree(results, rng), "eval_loss") for _ in range(20)}
    assert means == {statistics.fmean(values)}
    orders = {sum(rng.sample(values, len(values))) / len(values) for _ in range(20)}
    assert len(orders) > 1  # a (float sum, count) pair would depend on the tree
    assert held_out_loss(StepSummary.of_all(results)) == statistics.fmean(values)
    nan = figure_value(fold([*results, _result(9, eval_loss=math.nan, eval_s=1.0)]), "eval_loss")
    assert math.isnan(nan)


def test_no_extras_record_nothing_and_a_step_without_evaluation_has_no_held_out_loss():
    results = [_result(r) for r in range(3)]
    assert fold(results) == {} and held_out_loss(StepSummary.of_all(results)) is None
    record = step_record(StepSummary.of_all(results), step_s=1.0, tokens=64, end_time=0.0, checkpoint_s=0.0)
    assert set(record) & set(FIGURES) == {"memory"}  # the core per-rank memory; the figure's is not recorded


def test_asp_rounds_average_the_finite_norms_and_an_empty_comm_count_is_not_recorded():
    rounds = [StepResult(rank=r, step=3, loss=2.0, grad_norm=n, lr=1e-3, tokens=8, applied=True,
                         time_s=StepTimes(), peak_memory_bytes=1, current_memory_bytes=1, local_steps=1, clock=4,
                         comm_bytes={}) for r, n in enumerate([1.0, math.nan, 3.0])]
    record = step_record(StepSummary.of_all(rounds), step_s=1.0, tokens=64, end_time=0.0, checkpoint_s=0.0)
    assert record["grad_norm"] == 2.0 and "comm_bytes" not in record


@pytest.mark.parametrize("key", sorted(FIGURES))
def test_every_figure_merges_commutatively(key):
    a, b = [FIGURES[key].lift(r.extras[key], r.rank) for r in _ranks() if key in r.extras][:2]
    assert FIGURES[key].merge(a, b) == FIGURES[key].merge(b, a)
