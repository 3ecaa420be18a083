"""parallel.pp_split: the dynamic program against brute force, the layer ranges, the spec's errors, the planner."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from orchestrator.errors import SpecError
from orchestrator.planning.estimate import estimate, render, stage_params
from orchestrator.spec import JobSpec
from workers.parallel.layout import layers_of_stage
from workers.parallel.partition import balanced_split, split_problem, stage_bounds, stage_cost


def brute_force(times, n_stages, first, last, memory, limit):
    """The smallest slowest-stage cost over every contiguous split that fits ``limit`` (math.inf if none)."""
    n, best = len(times), math.inf
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        split = [b - a for a, b in itertools.pairwise((0, *cuts, n))]
        bounds = stage_bounds(split)
        if limit is not None and any(memory(s, r.start, r.stop) > limit for s, r in enumerate(bounds)):
            continue
        best = min(best, max(stage_cost(times, split, first, last)))
    return best


def test_dynamic_program_finds_the_brute_force_optimum_under_a_memory_limit():
    rng = random.Random(7)
    checked = infeasible = 0
    for _ in range(300):
        n = rng.randint(1, 8)
        n_stages = rng.randint(1, n)
        times = [rng.choice([0.5, 1.0, 2.0, rng.uniform(0.1, 5)]) for _ in range(n)]
        first, last = rng.uniform(0, 3), rng.uniform(0, 8)
        weights = [rng.uniform(1, 4) for _ in range(n)]
        flight = [rng.randint(1, n_stages) for _ in range(n_stages)]

        def memory(stage, lo, hi, weights=weights, flight=flight):
            return flight[stage] * sum(weights[lo:hi])

        limit = rng.choice([None, rng.uniform(2, 20)])
        expected = brute_force(times, n_stages, first, last, memory, limit)
        if math.isinf(expected):
            infeasible += 1
            with pytest.raises(ValueError, match="no split"):
                balanced_split(times, n_stages, first, last, memory, limit)
            continue
        split = balanced_split(times, n_stages, first, last, memory, limit)
        assert split_problem(split, n, n_stages) is None
        assert max(stage_cost(times, split, first, last)) == pytest.approx(expected)
        if limit is not None:
            assert all(memory(s, r.start, r.stop) <= limit for s, r in enumerate(stage_bounds(split)))
        checked += 1
    assert checked > 150 and infeasible > 10  # both branches were exercised


def random_problem(rng: random.Random, most_layers: int) -> tuple[list[float], int, float, float]:
    """Layer times, stages, embedding and head costs of a random split: equal and zero times (ties are common),
    a head as light as a block or heavier."""
    n = rng.randint(1, most_layers)
    times = [rng.choice([0.0, 0.5, 1.0, 1.0, 2.0, rng.uniform(0, 5)]) for _ in range(n)]
    first, last = rng.choice([0.0, 1.0, rng.uniform(0, 3)]), rng.choice([0.0, 1.0, rng.uniform(0, 8)])
    return times, rng.randint(1, n), first, last


def test_layer_caps_give_the_split_a_memory_rule_of_the_same_caps_gives():
    """``max_layers`` bounds where a stage may start instead of pricing every start: the same split (ties
    included: equal layer times tie everywhere) as the same caps asked of ``memory`` start by start."""
    rng = random.Random(11)
    compared = infeasible = 0
    for _ in range(400):
        times, n_stages, first, last = random_problem(rng, 12)
        caps = [rng.randint(0, len(times)) for _ in range(n_stages)]

        def over_cap(stage, lo, hi, caps=caps):
            return hi - lo - caps[stage]

        try:
            expected = balanced_split(times, n_stages, first, last, over_cap, 0)
        except ValueError:
            infeasible += 1
            with pytest.raises(ValueError, match=r"no split .* at most \["):
                balanced_split(times, n_stages, first, last, max_layers=caps)
            continue
        assert balanced_split(times, n_stages, first, last, max_layers=caps) == expected
        compared += 1
    assert compared > 150 and infeasible > 50  # both branches were exercised


def latest_stage_longest(times, n_stages, first, last):
    """The tie rule by enumeration: the last stage starts as early as an optimal split allows, and the stages
    before it split what precedes it the same way, for their own best (their slowest stage may be faster)."""
    prefix = list(itertools.accumulate(times, initial=0.0))

    def cost(stage, lo, hi):
        return prefix[hi] - prefix[lo] + (first if stage == 0 else 0.0) + (last if stage == n_stages - 1 else 0.0)

    def slowest(j, stages):  # the best slowest stage of layers [0, j) on stages 0..stages-1, enumerated
        return min(max(cost(s, a, b) for s, (a, b) in enumerate(itertools.pairwise((0, *cuts, j))))
                   for cuts in itertools.combinations(range(1, j), stages - 1))

    def split(j, stages):
        if stages == 1:
            return (j,)
        s = stages - 1
        best = slowest(j, stages)
        i = next(i for i in range(s, j) if max(slowest(i, s), cost(s, i, j)) == best)
        return (*split(i, s), j - i)

    return split(len(times), n_stages)


def test_stopping_the_scan_early_changes_no_split():
    """Without ``memory`` the program stops scanning a stage's starts once the stage alone costs more than the
    best so far; with a ``memory`` that refuses nothing it scans them all. Same split, capped or not, and the
    one the tie rule names (equal and zero layer times tie often)."""
    rng = random.Random(5)
    for _ in range(400):
        times, n_stages, first, last = random_problem(rng, 12)
        caps = rng.choice([None, [rng.randint(1, len(times)) for _ in range(n_stages)]])
        try:
            whole = balanced_split(times, n_stages, first, last, lambda *_: 0, 1, max_layers=caps)
        except ValueError:
            continue
        assert balanced_split(times, n_stages, first, last, max_layers=caps) == whole
        if caps is None:
            assert whole == latest_stage_longest(times, n_stages, first, last)


def test_a_heavy_head_moves_layers_to_the_first_stage():
    assert balanced_split([1.0] * 6, 2, first=0.1, last=3.0) == (4, 2)  # 4.1 vs 5.0, even would be 3.1 vs 6.0
    assert balanced_split([1.0] * 6, 2) == (3, 3)


def test_layers_of_stage_follows_the_split_and_defaults_to_even():
    assert [layers_of_stage(s, 3, 6) for s in range(3)] == [range(0, 2), range(2, 4), range(4, 6)]
    assert [layers_of_stage(s, 3, 6, (3, 2, 1)) for s in range(3)] == [range(0, 3), range(3, 5), range(5, 6)]
    assert layers_of_stage(0, 1, 6, (3, 2, 1)) == range(0, 6)  # a split for another stage count is ignored


BASE = {"data": {"path": "/tmp/unused"}, "model": {"d_model": 32, "n_layers": 5, "n_heads": 4, "seq_len": 32},
        "train": {"global_batch_size": 8, "microbatches": 4}}


def _spec(parallel: dict, **model) -> JobSpec:
    return JobSpec.from_dict({**BASE, "model": {**BASE["model"], **model}, "parallel": {"device": "cpu", **parallel}})


@pytest.mark.parametrize(("split", "words"), [
    ([3, 1], ["sums to 4", "model.n_layers is 5"]),
    ([5], ["1 entries", "2 stages"]),
    ([2, 2, 1], ["3 entries"]),
])
def test_a_wrong_layer_list_names_the_field_the_value_and_the_fix(split, words):
    with pytest.raises(SpecError) as err:
        _spec({"pp": 2, "pp_split": split})
    message = str(err.value)
    assert "parallel.pp_split" in message and str(split) in message and "summing to model.n_layers=5" in message
    assert all(w in message for w in words)


def test_zero_layers_and_unknown_words_are_refused():
    with pytest.raises(SpecError, match="parallel.pp_split"):
        _spec({"pp": 2, "pp_split": [5, 0]})
    with pytest.raises(SpecError, match="parallel.pp_split"):
        _spec({"pp": 2, "pp_split": "balanced"})
    with pytest.raises(SpecError, match="cannot give each of 4 pipeline stages"):
        _spec({"pp": 4, "pp_split": "auto"}, n_layers=3)


@pytest.mark.parametrize("value", ["balanced", float("nan"), 1e300, [1, 1e9]])
def test_a_bad_split_names_the_field_without_pydantic_union_tags(value):
    """pydantic locates a union field's error under its member's tag (`pp_split.literal['even','auto']`); the
    message names the job-file field and every accepted form."""
    with pytest.raises(SpecError) as err:
        _spec({"pp": 2, "pp_split": value})
    assert err.value.field == "parallel.pp_split"
    assert "one of even, auto, or a list" in str(err.value)


def test_an_uneven_layer_count_suggests_pp_split():
    with pytest.raises(SpecError, match="pp_split: auto"):
        _spec({"pp": 2})


def test_a_list_covers_virtual_stages_and_reaches_the_workers_and_the_planner():
    spec = _spec({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_split": [2, 1, 1, 1]})
    assert spec.worker_dict()["parallel"]["pp_split"] == [2, 1, 1, 1]
    # rank 0 holds stages 0 and 2 (3 blocks), rank 1 stages 1 and 3 (2 blocks and the head)
    block = stage_params(spec, 1, 4)[0]
    assert stage_params(spec, 0, 4)[0] == 2 * block + spec.model.vocab_size * 32  # 2 blocks and the embedding
    assert "pp_split [2, 1, 1, 1]" in render(spec)
    ranks = estimate(spec)
    assert ranks[0].params != ranks[1].params


def test_even_stays_the_default_and_is_what_the_workers_get():
    spec = _spec({"pp": 2}, n_layers=4)
    assert spec.parallel.pp_split == "even" and spec.worker_dict()["parallel"]["pp_split"] == [2, 2]


# a head as wide as 16384 words on a 32-wide model: its matmuls and log-softmax outweigh a block many times, so
# the measured profile says so however loaded the machine is (at 4096 words a busy 2-core host once timed it
# as light as a block, and the split stayed even)
VOCAB = 16384
HEAVY_HEAD = {"n_layers": 6, "vocab_size": VOCAB}


def test_the_profile_attributes_parameters_activations_and_time_to_each_unit():
    from workers.model.registry import model_config
    from workers.parallel.stage_profile import profile_model

    cfg = model_config({**BASE["model"], **HEAVY_HEAD})
    costs = profile_model(cfg, micro_batch=2, steps=3)
    assert costs.embedding.params == VOCAB * 32 and costs.head.params == VOCAB * 32 + 32  # output + final norm
    assert len({u.params for u in costs.layers}) == 1 and len(costs.layers) == 6
    assert costs.head.activation_bytes >= 4 * 2 * 32 * VOCAB  # the fp32 logits, saved for the loss's backward
    assert costs.embedding.activation_bytes < costs.layers[0].activation_bytes  # the embedding saves only ids
    assert all(u.forward_s > 0 and u.backward_s > 0 for u in (costs.embedding, *costs.layers, costs.head))
    assert costs.head.time_s > max(u.time_s for u in costs.layers)


def test_auto_moves_blocks_off_a_heavy_head_and_the_controller_pins_it():
    from orchestrator.planning.stage_split import auto_split, pin_split

    spec = _spec({"pp": 2, "pp_split": "auto"}, **HEAVY_HEAD)
    chosen = auto_split(spec)
    assert chosen.split[0] > chosen.split[1] and sum(chosen.split) == 6
    assert max(chosen.stage_seconds) < max(stage_cost([u.time_s for u in chosen.costs.layers], (3, 3),
                                                      chosen.costs.embedding.time_s, chosen.costs.head.time_s))
    pinned = pin_split(spec)
    assert pinned.parallel.pp_split == list(chosen.split) == pinned.worker_dict()["parallel"]["pp_split"]
    with pytest.raises(ValueError, match="pp_split 'auto' is not resolved yet: pin it first with .*pin_split"):
        spec.worker_dict()  # the spec does not profile: resolving `auto` is the planner's
    assert "pp_split auto: " in render(spec)


def test_auto_keeps_every_stage_within_the_device_memory():
    from orchestrator.planning.stage_split import auto_split, stage_memory

    free = auto_split(_spec({"pp": 2, "pp_split": "auto"}, **HEAVY_HEAD))
    tight = max(free.stage_bytes) - 1  # the unconstrained optimum no longer fits
    memory = stage_memory(free.costs, 2, 1, "1f1b", 4)
    fits = [(k, 6 - k) for k in range(1, 6) if memory(0, 0, k) <= tight and memory(1, k, 6) <= tight]
    spec = _spec({"pp": 2, "pp_split": "auto", "device_memory": tight}, **HEAVY_HEAD)
    if not fits:
        with pytest.raises(ValueError, match="no split"):
            auto_split(spec)
        return
    bounded = auto_split(spec)
    assert bounded.split in fits and bounded.split != free.split and max(bounded.stage_bytes) <= tight


def test_auto_refuses_a_model_too_big_to_profile_on_the_host():
    from orchestrator.planning.stage_split import auto_split

    big = _spec({"pp": 4, "pp_split": "auto"}, d_model=16384, n_heads=128, n_layers=128, vocab_size=128256)
    with pytest.raises(SpecError, match="parallel.pp_split.*would profile a model of .* give the layer counts"):
        auto_split(big)


def test_auto_profiles_in_a_fresh_process_that_measures_what_the_in_process_profile_does():
    from workers.model.registry import model_config
    from workers.parallel.stage_profile import profile_in_fresh_process, profile_model

    fields = {**BASE["model"], **HEAVY_HEAD}
    here, fresh = profile_model(model_config(fields), micro_batch=2, steps=1), profile_in_fresh_process(fields, 2)
    sizes = [[(u.params, u.activation_bytes) for u in (c.embedding, *c.layers, c.head)] for c in (here, fresh)]
    assert sizes[0] == sizes[1]
    assert all(u.forward_s > 0 and u.backward_s > 0 for u in (fresh.embedding, *fresh.layers, fresh.head))
    with pytest.raises(RuntimeError, match="pp_split: auto failed"):
        profile_in_fresh_process({**fields, "n_heads": 5}, 2)  # 32 wide does not split into 5 heads
    with pytest.raises(RuntimeError, match="took longer than 0.01 s"):
        profile_in_fresh_process(fields, 2, timeout_s=0.01)


def test_a_profile_that_cannot_run_is_refused_on_the_field_with_a_fix():
    import json

    from orchestrator.planning import stage_split

    with pytest.raises(SpecError) as raised:
        stage_split._profile(json.dumps({**BASE["model"], "n_heads": 5}), 2, 0)
    assert raised.value.field == "parallel.pp_split" and raised.value.value == "auto"
    assert "pp_split: even" in raised.value.fix and "exit 1" in raised.value.problem
