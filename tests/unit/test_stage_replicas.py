"""PipeDream's stage replication (``parallel.stage_replicas``, workers/parallel/replicated_pipeline.py): a stage on
its own number of ranks, microbatches dealt round-robin, trains as one process does.

* parity, without Ray (the parity harness, 3 spawned gloo ranks, float32 CPU): stage 0 on 2 ranks and stage 1 on 1,
  and the other way round (the loss then summed over two last-stage replicas), 4 microbatches, follow the
  single-process losses and gradient norms to 1e-4; the timeline shows microbatch m of stage s ran on the rank at
  position first(s) + m mod r_s, each forward and backward once;
* a checkpoint saved by the replicated layout resumes on it and continues the reference curve; dp=2 × [2, 1] (6
  ranks) stays on the curve too;
* the arithmetic (positions, round-robin) and the planner's rule: the bottleneck stage of a model's per-stage
  costs gets the spare ranks (``orchestrator/planning/stage_replicas.py``);
* the spec refuses what the executor does not run, naming field, value and fix.
"""

from __future__ import annotations

import pytest

from orchestrator.errors import SpecError
from orchestrator.planning.stage_replicas import ReplicationPlan, plan_replication, replication_advice
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layout, run_layouts
from tests.support.reference import reference_run
from workers.contract.stage_replicas import StageReplicas, replicate_bottleneck
from workers.model.meta_init import build_full

STEPS = 3
LAYOUTS = {"first-twice": [2, 1], "last-twice": [1, 2]}


def _spec(token_data, tmp_path, replicas, **parallel):
    return tiny_spec(token_data, tmp_path, parallel={"device": "cpu", "pp": sum(replicas), "stage_replicas": replicas,
                                                     "pp_schedule": "gpipe", **parallel},
                     train={"steps": STEPS, "global_batch_size": 8, "microbatches": 4},
                     metrics={"timeline": True})


@pytest.fixture(scope="module")
def runs(token_data, tmp_path_factory):
    """Both layouts for STEPS steps, then the first saved after 2 steps and resumed for 1, in one spawn of 3."""
    tmp = tmp_path_factory.mktemp("stage_replicas")
    ckpt = str(tmp / "ckpt")
    specs = [_spec(token_data, tmp, r).worker_dict() for r in LAYOUTS.values()]
    resumed = _spec(token_data, tmp, [2, 1]).worker_dict()
    out = run_layouts([*specs, specs[0], resumed], 3, [STEPS, STEPS, 2, 1],
                      checkpoints=[None, None, ckpt, None], resumes=[None, None, None, ckpt])
    return dict(zip([*LAYOUTS, "saved", "resumed"], out))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replicated_stages_follow_one_process(runs, name, token_data, tmp_path):
    losses, norms = reference_run(_spec(token_data, tmp_path, LAYOUTS[name]), STEPS)
    assert runs[name].losses == pytest.approx(losses, rel=1e-4)
    assert runs[name].grad_norms == pytest.approx(norms, rel=1e-4)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_microbatches_go_round_robin(runs, name):
    """Every (stage, microbatch) ran forward and backward once, on the replica m mod r_s of its stage."""
    replicas = StageReplicas(tuple(LAYOUTS[name]))
    ran: dict[tuple, list] = {}
    for rank, timelines in runs[name].field("timeline").items():
        for event in timelines[-1]:
            ran.setdefault((event["stage"], event["microbatch"], event["kind"]), []).append(rank)
            assert replicas.stage_of(rank) == (event["stage"], event["replica"])  # dp=1: rank = pp position
    assert ran == {(s, m, kind): [replicas.position_for(s, m)]
                   for s in range(2) for m in range(4) for kind in "FB"}
    assert {ranks[0] for (s, m, _), ranks in ran.items() if s == 0} == ({0, 1} if name == "first-twice" else {0})


def test_checkpoint_resumes_on_replicated_stages(runs, token_data, tmp_path):
    losses, _ = reference_run(_spec(token_data, tmp_path, [2, 1]), STEPS)
    assert runs["saved"].losses + runs["resumed"].losses == pytest.approx(losses, rel=1e-4)


def test_replicated_stages_under_data_parallelism(token_data, tmp_path):
    """dp=2 × [2, 1] (6 ranks): each data-parallel replica runs its own pipeline, a stage's gradients are summed
    over its replicas and averaged over dp in one all-reduce, and the run stays on the single-process curve."""
    spec = _spec(token_data, tmp_path, [2, 1], dp=2)
    run = run_layout(spec.worker_dict(), 6, 2)
    losses, norms = reference_run(spec, 2)
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(norms, rel=1e-4)


def test_round_robin_arithmetic():
    r = StageReplicas((2, 1, 3))
    assert r.positions == 6 and r.n_stages == 3
    assert [r.stage_of(p) for p in range(6)] == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (2, 2)]
    assert [r.position_for(2, m) for m in range(7)] == [3, 4, 5, 3, 4, 5, 3]
    assert r.microbatches_of(0, 1, 5) == [1, 3]
    with pytest.raises(ValueError, match="pipeline of 6 ranks"):
        r.stage_of(6)


def test_bottleneck_rule():
    assert replicate_bottleneck([1.0, 3.0], 4) == (1, 3)
    assert replicate_bottleneck([2.0, 1.0, 1.0], 4) == (2, 1, 1)
    assert replicate_bottleneck([1.0, 1.0], 3) == (2, 1)  # a tie goes to the earlier stage
    with pytest.raises(ValueError, match="at least one rank per stage"):
        replicate_bottleneck([1.0, 1.0, 1.0], 2)


def _counted_flops(spec, split) -> list[float]:
    """Each stage's training FLOPs per token from the built model's own parameters: 6 per weight of its blocks (and
    of the final norm and output head on the last stage), plus 12·L·d·s for its L blocks' attention scores."""
    model, m = build_full(spec.model, 0), spec.model
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    out, first = [], 0
    for stage, count in enumerate(split):
        weights = sum(n for name, n in sizes.items() if name.startswith("layers.")
                      and first <= int(name.split(".")[1]) < first + count)
        if stage == len(split) - 1:
            weights += sizes["norm.weight"] + sizes["output.weight"]
        out.append(6.0 * weights + 12.0 * count * m.d_model * m.seq_len)
        first += count
    return out


def test_planner_replicates_the_head_stage(token_data, tmp_path):
    """A 4-block model under a 4096-word head on a 3-rank pipeline split [2, 1, 1]: the head makes the last stage
    the bottleneck; two stages of 2 blocks with the head's stage twice halve it, which the planner proposes."""
    spec = tiny_spec(token_data, tmp_path, model={"vocab_size": 4096},
                     parallel={"pp": 3, "pp_split": [2, 1, 1]}, train={"microbatches": 4})
    own, halves = _counted_flops(spec, [2, 1, 1]), _counted_flops(spec, [2, 2])
    assert max(own) == own[-1]  # the head's stage is the slowest
    expected = replicate_bottleneck(halves, 3)
    assert expected == (1, 2)
    plan = plan_replication(spec)
    assert plan == ReplicationPlan((2, 2), expected, pytest.approx(tuple(halves), rel=1e-12))
    assert plan.bottleneck == pytest.approx(max(halves[0], halves[1] / 2)) and plan.bottleneck < max(own)
    assert "stage_replicas: [1, 2], pp_split: [2, 2]" in replication_advice(spec)


def test_planner_keeps_a_balanced_pipeline(token_data, tmp_path):
    """The tiny model's 256-word head weighs about a block: on 2 ranks replicating nothing is best, no advice."""
    spec = tiny_spec(token_data, tmp_path, parallel={"pp": 2})
    assert plan_replication(spec) is None and replication_advice(spec) is None


@pytest.mark.parametrize("changes, field", [
    ({"pp": 4}, "parallel.pp"),
    ({"pp_schedule": "1f1b"}, "parallel.pp_schedule"),
    ({"dp": 2, "zero": 1}, "parallel.zero"),
    ({"pp_split": "auto"}, "parallel.pp_split"),
])
def test_spec_refuses_what_it_cannot_run(token_data, tmp_path, changes, field):
    with pytest.raises(SpecError) as err:
        _spec(token_data, tmp_path, [2, 1], **changes)
    assert err.value.field == field
    assert "stage_replicas" in str(err.value)
