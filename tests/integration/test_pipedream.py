"""PipeDream's asynchronous schedules on spawned ranks (tests/support/parity_harness.py, no Ray), pp=2 x dp=2.

- weight stashing: every microbatch's backward runs on the weight version its forward ran on, while later
  microbatches already run on newer versions; with vertical sync every stage runs the first stage's version;
- PipeDream-2BW equals a single-process reference written here from the paper's update rule
  W(t+1) = W(t) - lr * grad f(W(t-1)), the gradient accumulated over each window of m microbatches, to 1e-5;
- a 2BW run saved and resumed (its second weight buffer in the checkpoint) continues bit for bit.
All four jobs share one spawn of the ranks (module-scoped).
"""

from __future__ import annotations

import copy

import pytest
import torch

from orchestrator.planning.bubble import measured_bubble, step_events
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts
from workers.data import DataCursor, TokenDataset
from workers.model.config import model_config
from workers.model.gpt import lm_loss
from workers.model.meta_init import build_full

STEPS, MICROBATCHES, EVERY, DP = 4, 4, 2, 2


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
             "2bw": _spec(token_data, tmp, pp_schedule="pipedream_2bw", pp_2bw_every=EVERY)}
    ckpt = str(tmp / "ckpt")
    out = run_layouts([s.worker_dict() for s in specs.values()] + [specs["2bw"].worker_dict()], 2 * DP, STEPS,
                      checkpoints=[None, None, ckpt, None], resumes=[None, None, None, ckpt],
                      save_afters=[None, None, 2, None])
    return {**dict(zip(specs, out)), "2bw-resumed": out[3], "specs": specs}


def _versions(run, step: int) -> dict[tuple[int, int, str], int]:
    """(pp rank, microbatch, F or B) -> weight version, from dp rank 0's replica of each stage at ``step``."""
    out = {}
    for steps in run.results.values():
        for e in steps[step]["timeline"]:
            out[(e["pp_rank"], e["microbatch"], e["kind"])] = e["version"]
    return out


def test_pipedream_backward_uses_the_forward_version(runs) -> None:
    run = runs["pipedream"]
    for step in range(STEPS):
        v = _versions(run, step)
        for pp_rank in (0, 1):
            assert [v[(pp_rank, j, "F")] for j in range(MICROBATCHES)] == \
                   [v[(pp_rank, j, "B")] for j in range(MICROBATCHES)]
        # one update per microbatch: stage 0 is two microbatches ahead in 1F1B, so microbatch 1 ran on the
        # step's first version and microbatch 2 on a newer one while microbatch 1's backward was still to come
        base = step * MICROBATCHES
        assert [v[(0, j, "F")] for j in range(MICROBATCHES)] == [base, base, base + 1, base + 2]
        assert [v[(1, j, "F")] for j in range(MICROBATCHES)] == [base + j for j in range(MICROBATCHES)]
    assert all(loss == loss for loss in run.losses)


def test_timeline_shows_the_steady_state(runs) -> None:
    """What `raymesh report` draws: on stage 0 two warm-up forwards, then forward and backward in turn with each
    backward on an older version than the forward beside it, then the cool-down; its bubble is measurable."""
    timeline = [e for steps in runs["pipedream"].results.values() for out in steps for e in out["timeline"]]
    events = sorted((e for e in step_events(timeline, 2) if e["pp_rank"] == 0), key=lambda e: e["start"])
    assert [f"{e['kind']}{e['microbatch']}" for e in events] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert events[3]["version"] > events[4]["version"]  # F2 on a newer version than B1 beside it
    assert 0 < measured_bubble(step_events(timeline, 2)) < 1


def test_vertical_sync_runs_the_first_stages_version_everywhere(runs) -> None:
    v = _versions(runs["vertical"], STEPS - 1)
    assert [v[(1, j, "F")] for j in range(MICROBATCHES)] == [v[(0, j, "F")] for j in range(MICROBATCHES)]
    assert all(v[(r, j, "F")] == v[(r, j, "B")] for r in (0, 1) for j in range(MICROBATCHES))
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
    v = _versions(runs["2bw"], 1)  # step 1 holds windows 2 and 3: versions 1 and 2
    assert [v[(r, j, k)] for r in (0, 1) for j in range(MICROBATCHES) for k in "FB"] == [1, 1, 1, 1, 2, 2, 2, 2] * 2


def test_2bw_resumes_bit_for_bit(runs) -> None:
    # saved after step 2 with its second buffer; the resumed job's steps 3 and 4 are the straight run's
    assert runs["2bw-resumed"].losses[:2] == runs["2bw"].losses[2:]
    assert runs["2bw-resumed"].grad_norms[:2] == runs["2bw"].grad_norms[2:]
