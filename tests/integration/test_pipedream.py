"""PipeDream's asynchronous schedules on spawned ranks (tests/support/parity_harness.py, no Ray), pp=2 x dp=2,
and their recovery on Ray.

- no flush at step ends: each step's last backward on stage 0 runs in the next step, after that step's first
  forward, and versions advance without a jump at the boundary; the final step drains;
- weight stashing: every microbatch's backward runs on the weight version its forward ran on (whichever step
  each ran in), while later microbatches already run on newer versions; with vertical sync every stage runs the
  first stage's version;
- PipeDream-2BW equals a single-process reference written here from the paper's update rule
  W(t+1) = W(t) - lr * grad f(W(t-1)), the gradient accumulated over each window of m microbatches, to 1e-5,
  carried across steps or drained at each (``pp_flush_per_step``: bit-identical, the version rule is timing-free);
- a run saved and resumed (stashed versions and in-flight microbatches in the checkpoint) continues bit for bit;
- on Ray, a killed rank is replaced and rolled back to its snapshot (versions, in-flight microbatches, outbox):
  the run is bit-identical to the uninterrupted one (trained in the harness, which gives a Ray job's bits).
The harness jobs share one spawn of the ranks (module-scoped).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from orchestrator import JobSpec, TrainingJob
from orchestrator.planning.bubble import measured_bubble, step_events
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped, run_layouts
from workers.data import DataCursor, TokenDataset
from workers.model.gpt import lm_loss
from workers.model.meta_init import build_full
from workers.model.registry import model_config

STEPS, MICROBATCHES, EVERY, DP, SAVE_AFTER = 4, 4, 2, 2, 2


def _spec(token_data, tmp_path, **parallel):
    # grad_clip 0: clipping is per stage under the asynchronous schedules, the reference clips nothing either
    return tiny_spec(token_data, tmp_path, parallel={"pp": 2, "dp": DP, "device": "cpu", **parallel},
                     train={"steps": STEPS, "microbatches": MICROBATCHES}, optim={"lr": 3e-3, "grad_clip": 0.0},
                     metrics={"timeline": True})


@pytest.fixture(scope="module")
def runs(token_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipedream")
    specs = {"pipedream": _spec(token_data, tmp, pp_schedule="pipedream"),
             "vertical": _spec(token_data, tmp, pp_schedule="pipedream", pp_vertical_sync=True),
             "2bw": _spec(token_data, tmp, pp_schedule="pipedream_2bw", pp_2bw_every=EVERY),
             "2bw-flushed": _spec(token_data, tmp, pp_schedule="pipedream_2bw", pp_2bw_every=EVERY,
                                  pp_flush_per_step=True)}
    saved = {"pipedream": str(tmp / "ckpt-pd"), "2bw": str(tmp / "ckpt-2bw")}
    names = [*specs, "pipedream-resumed", "2bw-resumed"]
    out = run_layouts([s.worker_dict() for s in specs.values()] + [specs["pipedream"].worker_dict(),
                                                                  specs["2bw"].worker_dict()], 2 * DP, STEPS,
                      checkpoints=[saved.get(n) for n in names], resumes=[None] * 4 + list(saved.values()),
                      save_afters=[SAVE_AFTER if n in saved else None for n in names])
    return {**dict(zip(names, out)), "specs": specs}


def _versions(run) -> dict[tuple[int, int, str], int]:
    """(pp rank, global microbatch, F or B) -> weight version, over all steps, from each rank's events (dp
    replicas agree)."""
    out = {}
    for steps in run.results.values():
        for record in steps:
            for e in record["timeline"]:
                out[(e["pp_rank"], e["microbatch"], e["kind"])] = e["version"]
    return out


def _order(run, step: int, pp_rank: int) -> list[str]:
    """Stage ``pp_rank``'s events of ``step`` (counted from 1, as the records are) in the order they ran."""
    events = sorted((e for e in step_events(_timeline(run), step) if e["pp_rank"] == pp_rank), key=lambda e: e["start"])
    return [f"{e['kind']}{e['microbatch']}" for e in events]


def _timeline(run) -> list[dict]:
    return [e for steps in run.results.values() for out in steps for e in out["timeline"]]


def test_pipedream_backward_uses_the_forward_version_across_steps(runs) -> None:
    v = _versions(runs["pipedream"])
    every = range(STEPS * MICROBATCHES)
    for pp_rank in (0, 1):
        assert [v[(pp_rank, n, "F")] for n in every] == [v[(pp_rank, n, "B")] for n in every]
    # one update per microbatch and no flush: stage 0 runs one microbatch ahead, so microbatch n runs on the
    # version after n - 1 updates, steadily across step boundaries (a flush would restart each step at its base)
    assert [v[(0, n, "F")] for n in every] == [max(0, n - 1) for n in every]
    assert [v[(1, n, "F")] for n in every] == list(every)
    assert all(loss == loss for loss in runs["pipedream"].losses)


def test_the_steady_state_carries_across_step_boundaries(runs) -> None:
    """What `raymesh report` draws: stage 0 warms up once (F0 F1), its last backward of a step runs in the next
    step after that step's first forward, and only the job's last step drains; the bubble is measurable."""
    run = runs["pipedream"]
    assert _order(run, 1, 0) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2"]
    assert _order(run, 2, 0) == ["F4", "B3", "F5", "B4", "F6", "B5", "F7", "B6"]
    assert _order(run, STEPS, 0) == ["F12", "B11", "F13", "B12", "F14", "B13", "F15", "B14", "B15"]
    assert _order(run, 2, 1) == ["F4", "B4", "F5", "B5", "F6", "B6", "F7", "B7"]  # the last stage: its own only
    assert 0 < measured_bubble(step_events(_timeline(run), 2)) < 1
    # a carried backward runs on an older version than the forward before it: B3 (version 2) after F4 (version 3)
    v = _versions(run)
    assert v[(0, 3, "B")] < v[(0, 4, "F")]
    flushed = runs["2bw-flushed"]  # pp_flush_per_step: every step warms up and drains
    assert _order(flushed, 2, 0) == ["F4", "F5", "B4", "F6", "B5", "F7", "B6", "B7"]


def test_vertical_sync_runs_the_first_stages_version_everywhere(runs) -> None:
    v = _versions(runs["vertical"])
    every = range(STEPS * MICROBATCHES)
    assert [v[(1, n, "F")] for n in every] == [v[(0, n, "F")] for n in every]
    assert all(v[(r, n, "F")] == v[(r, n, "B")] for r in (0, 1) for n in every)
    assert runs["vertical"].losses != runs["pipedream"].losses  # stage 1 ran on older weights


def reference_2bw(spec, steps: int, every: int) -> list[float]:
    """PipeDream-2BW from its update rule, single process: each window of ``every`` microbatches (per dp rank)
    takes its gradient at the version before the current one, W(t-1), and applies it to W(t) (W(-1) = W(0))."""
    model = build_full(model_config(spec.worker_dict()["model"]), spec.train.seed)
    previous = copy.deepcopy(model)
    o = spec.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    cursor = DataCursor(TokenDataset(spec.data.path, spec.model.seq_len, spec.data.seed),
                        spec.train.global_batch_size, dp_rank=0, dp_size=1)
    windows = spec.train.microbatches // every
    losses = []
    for _ in range(steps):
        inputs, targets = cursor.next_batch()
        # the batch is cut into dp slices; window w is the w-th share of every slice
        cut = [(x.chunk(windows), y.chunk(windows)) for x, y in zip(inputs.chunk(DP), targets.chunk(DP))]
        step_losses = []
        for w in range(windows):
            x, y = torch.cat([xs[w] for xs, _ in cut]), torch.cat([ys[w] for _, ys in cut])
            loss = lm_loss(previous(x), y)
            grads = torch.autograd.grad(loss, list(previous.parameters()))
            previous.load_state_dict(model.state_dict())  # W(t) is the previous version of W(t+1)
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            opt.step()
            opt.zero_grad()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / windows)
    return losses


def test_2bw_equals_the_paper_update_rule(runs) -> None:
    spec = runs["specs"]["2bw"]
    assert runs["2bw"].losses == pytest.approx(reference_2bw(spec, STEPS, EVERY), rel=1e-5)
    v = _versions(runs["2bw"])  # step 1 holds windows 2 and 3: versions 1 and 2
    assert [v[(r, n, k)] for r in (0, 1) for n in range(4, 8) for k in "FB"] == [1, 1, 1, 1, 2, 2, 2, 2] * 2
    # which version a microbatch runs on does not depend on when backwards run: drained or not, the same bits
    # (the grad_norm records differ: each is of a stage's last update run in the step, on stage 0 carried the
    # previous window's, drained the step's last)
    assert runs["2bw-flushed"].losses == runs["2bw"].losses


@pytest.mark.parametrize("name", ["pipedream", "2bw"])
def test_resumes_bit_for_bit_with_microbatches_in_flight(runs, name) -> None:
    # saved after step 2 (stage 0 holds microbatch 7 in flight, stage 1 its gradient; 2BW also its second buffer);
    # the resumed job's steps 3 and 4 are the straight run's (it drains at step 4, the job's last, as that did)
    resumed, straight = runs[f"{name}-resumed"], runs[name]
    assert resumed.losses[:2] == straight.losses[SAVE_AFTER:]
    assert resumed.grad_norms[:2] == straight.grad_norms[SAVE_AFTER:]


# -- recovery on Ray -----------------------------------------------------------------------------------------

RAY_STEPS = 6
# the Ray recovery tests' layouts: pp=2 under each asynchronous schedule, and pp=2 x dp=2 on the job file's defaults
RAY_LAYOUTS = {"pipedream": ("pipedream", 1, None), "pipedream_2bw": ("pipedream_2bw", 1, None),
               "2bw-dp2-defaults": ("pipedream_2bw", 2, {})}


def _ray_spec(token_data, tmp_path, schedule: str, dp: int = 1, checkpoint: dict | None = None) -> JobSpec:
    return tiny_spec(token_data, tmp_path, parallel={"pp": 2, "dp": dp, "pp_schedule": schedule},
                     train={"steps": RAY_STEPS, "microbatches": MICROBATCHES}, optim={"lr": 3e-3, "grad_clip": 0.0},
                     checkpoint={"memory_every": 1} if checkpoint is None else checkpoint, metrics={"timeline": True},
                     fault_tolerance={"heartbeat_timeout_s": 20, "collective_timeout_s": 5})


@pytest.fixture(scope="module")
def straights(token_data, tmp_path_factory):
    """The uninterrupted runs the Ray recovery tests compare with, trained in the harness (the same Trainer gives
    the Ray job's bits; one spawn per world size instead of a controller and rank actors each)."""
    tmp = tmp_path_factory.mktemp("pipedream-straight")
    return run_grouped({name: _ray_spec(token_data, tmp / name, *layout) for name, layout in RAY_LAYOUTS.items()})


def _killed(token_data, tmp_path, name: str, kill: dict):
    spec = _ray_spec(token_data, tmp_path, *RAY_LAYOUTS[name])
    return TrainingJob(JobSpec.from_dict({**spec.to_dict(), "faults": [kill]}), progress=False).run()


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw"])
def test_kill_rank_recovers_bit_identical(schedule, ray_cluster, token_data, tmp_path, straights):
    """Rank 0 (stage 0, holding a microbatch in flight and two weight versions at every boundary) dies at step 4:
    its replacement restores the snapshot of step 3, re-runs the in-flight forward, and the run goes on as the
    uninterrupted one, bit for bit."""
    straight = ran(straights, schedule)
    killed = _killed(token_data, tmp_path / "killed", schedule, {"kind": "kill_rank", "rank": 0, "at_step": 4})
    assert killed.losses == straight.losses and killed.grad_norms == straight.grad_norms
    assert [(r["kind"], r["rank"], r["source"]) for r in killed.recoveries] == [("rank", 0, "memory")]
    # the step re-run after the rollback began with the restored in-flight microbatch's backward, on its version
    timeline = [json.loads(line) for line in (tmp_path / "killed" / "run" / "timeline.jsonl").read_text().splitlines()]
    stage0 = sorted((e for e in timeline if e["step"] == 4 and e["pp_rank"] == 0), key=lambda e: e["start"])
    assert [f"{e['kind']}{e['microbatch']}" for e in stage0[:2]] == ["F12", "B11"]
    versions = {(e["pp_rank"], e["microbatch"], e["kind"]): e["version"] for e in timeline}
    assert all(versions[(r, n, "B")] == versions[(r, n, "F")] for r, n, _ in versions)


def test_kill_rank_with_data_parallel_stages_recovers_bit_identical_on_defaults(ray_cluster, token_data, tmp_path,
                                                                               straights):
    """pp=2 x dp=2: the two dp ranks of a stage share weights but not their microbatches in flight (each holds
    its own data's), so a peer's snapshot is not a dead rank's replica; its holder's shipped copy is, and the
    run goes on as the uninterrupted one, bit for bit. On the job file's defaults: replicas ship, so snapshots
    are every 10 steps and the kill before step 4 rolls back to step 0's."""
    straight = ran(straights, "2bw-dp2-defaults")
    kill = {"kind": "kill_rank", "rank": 1, "at_step": 4}
    killed = _killed(token_data, tmp_path / "killed", "2bw-dp2-defaults", kill)
    assert killed.losses == straight.losses and killed.grad_norms == straight.grad_norms
    (rec,) = killed.recoveries
    assert (rec["kind"], rec["rank"], rec["source"], rec["lost_steps"]) == ("rank", 1, "memory", 3)
