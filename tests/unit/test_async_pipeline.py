"""PipeDream's asynchronous schedules without processes: the 1F1B order sliced into steps, which version a
microbatch runs on, the stash of weight versions, and the job-file checks (tests/integration/test_pipedream.py
runs them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec
from workers.parallel.async_pipeline import WeightVersions, rules_for, step_order


def one_f_one_b(stage: int, n_stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The non-interleaved 1F1B order of one stage over ``microbatches`` (Narayanan et al.): pp - s - 1 warm-up
    forwards, then one forward and one backward in turn, then the remaining backwards."""
    warm = min(n_stages - stage - 1, microbatches)
    order = [("F", j) for j in range(warm)]
    for i in range(microbatches - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", j) for j in range(microbatches - warm, microbatches)]


@pytest.mark.parametrize("stage, n_stages, microbatches", [(0, 2, 4), (1, 2, 4), (0, 4, 4), (1, 4, 4), (0, 4, 2)])
def test_steps_slice_one_endless_1f1b_order(stage: int, n_stages: int, microbatches: int) -> None:
    """No flush at step ends: three steps' slices, the last drained, are 1F1B over all their microbatches at once
    (a step's backwards may be the previous step's microbatches), and each step runs its own m forwards."""
    warm, steps, in_flight, run = n_stages - stage - 1, 3, [], []
    for step in range(steps):
        order = step_order(warm, step * microbatches, microbatches, in_flight, drain=step == steps - 1)
        assert [n for kind, n in order if kind == "F"] == list(range(step * microbatches, (step + 1) * microbatches))
        done = {n for kind, n in order if kind == "B"}
        in_flight = [n for n in in_flight + [n for kind, n in order if kind == "F"] if n not in done]
        assert len(in_flight) == min(warm, (step + 1) * microbatches) or step == steps - 1
        run += order
    assert run == one_f_one_b(stage, n_stages, steps * microbatches)
    assert step_order(1, 4, 4, [3], drain=False) == [("F", 4), ("B", 3), ("F", 5), ("B", 4), ("F", 6), ("B", 5),
                                                     ("F", 7), ("B", 6)]
    assert step_order(1, 0, 4, [], drain=True)[-2:] == [("B", 2), ("B", 3)]  # pp_flush_per_step: each step drains


def test_2bw_runs_each_window_one_version_late() -> None:
    rules = rules_for("pipedream_2bw", every=4, vertical_sync=False)
    # windows 0 and 1 run on the initial weights, window w on version w - 1 (W(t+1) = W(t) - lr*grad f(W(t-1)))
    assert [rules.first_stage_version(n, current=99) for n in range(0, 16, 2)] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert rules.follow_first_stage and rules.floor(current=3, newest_seen=0) == 2


def test_pipedream_takes_the_newest_version_unless_vertical_sync() -> None:
    plain, synced = rules_for("pipedream", 4, False), rules_for("pipedream", 4, True)
    assert (plain.every, synced.every) == (1, 1)  # an update after every microbatch
    assert plain.first_stage_version(7, current=5) == 5 and not plain.follow_first_stage
    assert plain.floor(current=5, newest_seen=2) == 5
    assert synced.follow_first_stage and synced.floor(current=5, newest_seen=2) == 2


def test_weight_versions_stash_copies_and_release() -> None:
    layer = nn.Linear(2, 2)
    versions = WeightVersions(layer, keep_previous=True)
    v0 = versions.weights(0)
    assert all(a is not b and torch.equal(a, b) for a, b in zip(v0, versions.live))
    versions.before_update()  # keeps version 0 (a later microbatch may still ask for it)
    with torch.no_grad():
        layer.weight.add_(1.0)
    assert versions.current == 1 and torch.equal(versions.weights(0)[0], v0[0])
    assert not torch.equal(versions.weights(1)[0], v0[0])
    versions.release(floor=1, in_flight={0})  # still running on version 0: kept
    assert sorted(versions.stash) == [0, 1]
    versions.release(floor=1, in_flight=set())
    assert sorted(versions.stash) == [1]
    with pytest.raises(RuntimeError, match="version 0 is gone"):
        versions.weights(0)


def _spec(parallel: dict, **sections) -> JobSpec:
    raw = {"model": {"n_layers": 4}, "train": {"global_batch_size": 16, "microbatches": 4},
           "data": {"path": "data/tiny"}, **sections}
    return JobSpec.from_dict({**raw, "parallel": {"pp": 2, "pp_schedule": "pipedream", **parallel}})


@pytest.mark.parametrize("parallel, sections, field", [
    ({"zero": 1, "dp": 2}, {}, "parallel.zero"),
    ({"tp": 2}, {}, "parallel.tp"),
    ({}, {"memory": {"recompute": "full"}}, "memory.recompute"),
    ({}, {"precision": {"dtype": "fp16"}}, "precision.dtype"),
    ({"pp": 1}, {}, "parallel.pp"),
    ({"pp_schedule": "1f1b", "pp_vertical_sync": True}, {}, "parallel.pp_vertical_sync"),
    ({"pp_2bw_every": 2}, {}, "parallel.pp_2bw_every"),
    ({"pp_schedule": "pipedream_2bw", "pp_2bw_every": 1}, {}, "parallel.pp_2bw_every"),  # below pp
    ({"pp_schedule": "pipedream_2bw", "pp_2bw_every": 3}, {}, "parallel.pp_2bw_every"),  # does not divide 4
    ({"pp_schedule": "1f1b", "pp_flush_per_step": True}, {}, "parallel.pp_flush_per_step"),
])
def test_refused_combinations_name_field_and_fix(parallel: dict, sections: dict, field: str) -> None:
    with pytest.raises(SpecError) as info:
        _spec(parallel, **sections)
    assert info.value.field == field and info.value.fix


def test_accepted_async_jobs() -> None:
    assert _spec({"pp_vertical_sync": True, "dp": 2}).parallel.pp_vertical_sync
    assert _spec({"pp_schedule": "pipedream_2bw", "pp_2bw_every": 2}).parallel.pp_2bw_every == 2
    assert _spec({"pp_schedule": "pipedream_2bw"}).parallel.pp_2bw_every is None  # one version per step
    assert _spec({"pp_flush_per_step": True}).parallel.pp_flush_per_step


def test_planner_counts_stashed_weight_versions() -> None:
    """The memory estimate adds a copy of the stage's weights per stashed version: pp - r under PipeDream
    (rank 0 of pp=2 holds 2), two under 2BW, none under 1F1B."""
    from orchestrator.planning.estimate import estimate_rank

    def buffers(**parallel) -> int:
        return estimate_rank(_spec(parallel), 0).buffer_bytes

    base = buffers(pp_schedule="1f1b")
    stage_weights = (buffers(pp_schedule="pipedream_2bw") - base) // 2
    assert stage_weights > 0
    assert buffers(pp_schedule="pipedream") - base == 2 * stage_weights


def test_snapshots_carry_the_step_boundary_state(token_data) -> None:
    """An in-memory snapshot (the recovery path) keeps what a step boundary holds besides the live weights: 2BW's
    previous version, the microbatch in flight (its input and version; its forward re-runs on restore, to the
    same output), the gradient held for the previous stage, the window's gradient so far and the LR its update
    is due at. A rank rolled back goes on exactly as an uninterrupted run would."""
    from workers.data import DataCursor, TokenDataset
    from workers.parallel.async_pipeline import AsyncPipeline, InFlight
    from workers.state import snapshot
    from workers.state.train_state import TrainState

    module = nn.Linear(4, 4)
    opt = torch.optim.AdamW(module.parameters())
    state = TrainState([module], [opt], [torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)],
                       DataCursor(TokenDataset(token_data, 8, 0), 4, dp_rank=0, dp_size=1))
    pipe = AsyncPipeline(module, 1, 3, 4, rules_for("pipedream_2bw", 4, False), opt, None, None, None, 0.0,
                         torch.device("cpu"))
    state.weight_versions = pipe
    state.step = 3
    pipe.resume_at(3)  # one version per step: at version 3, the next window runs on version 2
    previous = [torch.randn_like(p) for p in module.parameters()]
    pipe.versions.stash[2] = previous
    job = pipe.in_flight[15] = InFlight(torch.randn(2, 4), 2)
    pipe._run_forward(job)
    pipe.outbox = [torch.randn(2, 4)]
    pipe.step_lrs = {3: [0.5]}
    module.weight.grad = torch.randn(4, 4)
    expected = (job.out.detach().clone(), pipe.outbox[0].clone(), module.weight.grad.clone())
    snap = snapshot.take(state)
    state.step = 5
    pipe.resume_at(5)
    assert not pipe.in_flight and module.weight.grad is None
    snapshot.restore(state, snap)
    assert state.step == 3 and pipe.versions.current == 3 and pipe.step_lrs == {3: [0.5]}
    assert all(torch.equal(a, b) for a, b in zip(pipe.versions.weights(2), previous))
    assert list(pipe.in_flight) == [15] and pipe.in_flight[15].out is None
    pipe._rerun_restored()
    assert torch.equal(pipe.in_flight[15].out, expected[0]) and pipe.in_flight[15].x.requires_grad
    assert torch.equal(pipe.outbox[0], expected[1]) and torch.equal(module.weight.grad, expected[2])
    other = AsyncPipeline(module, 1, 3, 8, rules_for("pipedream_2bw", 8, False), opt, None, None, None, 0.0,
                          torch.device("cpu"))
    with pytest.raises(ValueError, match=r"saved as \[1, 3, 4, 4\].*resume only at the layout that saved them"):
        other.load_state_dict(snap["weight_versions"], 3)
    with pytest.raises(ValueError, match=r"it holds \['pp2_dp0'\]"):  # another stage's entry only
        pipe.load_state_dict({"pp2_dp0": snap["weight_versions"]["pp1_dp0"]}, 3)
