"""`parallel.dp_sync: diloco` (workers/step/diloco.py) against DiLoCo's rule spelled out in one process, resumed
mid-round bit for bit, and its refusals. Ray-free: the ranks are the parity harness's gloo processes."""

from __future__ import annotations

import pytest
import torch

from orchestrator.errors import SpecError
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import rank_ports, run_layouts, spawn_ranks
from tests.support.reference import _lm_objective, _optimizer
from tests.support.snapshot_ranks import replay_from_snapshot
from workers.data import DataCursor, open_data
from workers.model.meta_init import build_full
from workers.model.registry import model_config

H, STEPS = 3, 7  # two outer steps, then a round cut short


def _spec(token_data, tmp_path, dp: int, pp: int = 1, metrics: dict | None = None, **parallel):
    return tiny_spec(token_data, tmp_path, parallel={"dp": dp, "pp": pp, "dp_sync": "diloco",
                                                     "diloco_inner_steps": H, **parallel}, metrics=metrics or {})


def reference_diloco(spec, steps: int) -> tuple[list[float], list[float]]:
    """DiLoCo from the paper's rule, the dp replicas simulated one after another: replica ``r`` is a whole model
    with the job's optimizer of its own, training on dp share ``r`` of every global batch; after every H-th step
    ``delta = mean_r(theta_outer - theta_r)``, the Nesterov momentum ``m = mu * m + delta``, ``theta_outer -= lr *
    (delta + mu * m)``, and every replica takes ``theta_outer``. Per step: the replicas' mean loss, replica 0's
    pre-clip gradient norm (what the controller records)."""
    p, o = spec.parallel, spec.optim
    data = open_data(spec.data.path, None, spec.model.seq_len, spec.data.seed)
    replicas = [build_full(model_config(spec.worker_dict()["model"]), spec.train.seed) for _ in range(p.dp)]
    optimizers = [_optimizer(m, o) for m in replicas]
    cursors = [DataCursor(data, spec.train.global_batch_size, dp_rank=r, dp_size=p.dp) for r in range(p.dp)]
    outer = [t.detach().clone() for t in replicas[0].parameters()]
    momentum = [torch.zeros_like(t) for t in outer]
    loss_of, losses, norms = _lm_objective(spec), [], []
    for step in range(1, steps + 1):
        step_losses = []
        for r, (model, opt, cursor) in enumerate(zip(replicas, optimizers, cursors)):
            loss = loss_of(model, *cursor.next_batch())
            loss.backward()
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip))
            opt.step()
            opt.zero_grad()
            step_losses.append(loss.item())
            norms += [norm] if r == 0 else []
        losses.append(sum(step_losses) / p.dp)
        if step % p.diloco_inner_steps == 0:
            mu, lr = p.diloco_outer_momentum, p.diloco_outer_lr
            with torch.no_grad():
                for i, theta in enumerate(outer):
                    delta = sum(theta - list(m.parameters())[i] for m in replicas) / p.dp
                    momentum[i] = mu * momentum[i] + delta
                    theta -= lr * (delta + mu * momentum[i])
                    for m in replicas:
                        list(m.parameters())[i].copy_(theta)
    return losses, norms


@pytest.fixture(scope="module")
def layouts(token_data, tmp_path_factory):
    """dp=4 and dp=2 x pp=2 in one spawn of four ranks, and dp=2 with a save mid-round and its resume."""
    tmp = tmp_path_factory.mktemp("diloco")
    specs = {"dp4": _spec(token_data, tmp, 4), "dp2pp2": _spec(token_data, tmp, 2, pp=2)}
    four = run_layouts([s.worker_dict() for s in specs.values()], 4, STEPS)
    ckpt = str(tmp / "ckpt")
    two = _spec(token_data, tmp, 2, metrics={"comm_bytes": True})  # counted: the resume holds with the counter on
    whole, saved, resumed = run_layouts([two.worker_dict()] * 3, 2, [STEPS, 4, STEPS - 4],
                                        checkpoints=[None, ckpt, None], resumes=[None, None, ckpt])
    return {"dp4": (specs["dp4"], four[0]), "dp2pp2": (specs["dp2pp2"], four[1]), "dp2": (two, whole),
            "saved": saved, "resumed": resumed, "ckpt": ckpt}


@pytest.mark.parametrize("layout", ["dp2", "dp4", "dp2pp2"])
def test_diloco_follows_the_papers_rule(layouts, layout):
    spec, run = layouts[layout]
    losses, norms = reference_diloco(spec, STEPS)
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(norms, rel=1e-4)
    assert len(set(run.losses[:H])) == H  # the replicas did train: not a flat line


def test_diloco_replicas_differ_between_outer_steps(layouts):
    """Without a gradient all-reduce the replicas' losses differ on their own data (the check has teeth: an
    all-reduce run would still differ by data, so also the reference with H huge must differ from the run)."""
    spec, run = layouts["dp2"]
    never = spec.model_copy(update={"parallel": spec.parallel.model_copy(update={"diloco_inner_steps": 10_000})})
    assert run.losses[H:] != pytest.approx(reference_diloco(never, STEPS)[0][H:], rel=1e-4)


def test_diloco_resumes_mid_round_bit_for_bit(layouts):
    """Saved after step 4 (one step into the second round: the replicas' weights and moments differ) and
    resumed: the remaining steps, through the outer step at 6, are the uninterrupted run's exactly."""
    _, whole = layouts["dp2"]
    assert layouts["saved"].losses == whole.losses[:4]
    assert layouts["resumed"].losses == whole.losses[4:]
    assert layouts["resumed"].grad_norms == whole.grad_norms[4:]
    assert layouts["resumed"].field("loss") == {r: v[4:] for r, v in whole.field("loss").items()}


def test_diloco_sends_one_weight_sized_all_reduce_per_round(layouts):
    """The dp bytes (``metrics.comm_bytes``) of every rank: nothing on the H - 1 inner steps of a round, and at each
    outer step one fp32 all-reduce of the weights, which is what an all-reduce run sends for the gradients every
    step (a ring all-reduce of S bytes over 2 ranks sends S); so H times fewer synchronisations and bytes."""
    spec, run = layouts["dp2"]
    weights = build_full(model_config(spec.worker_dict()["model"]), spec.train.seed)
    ring = 4 * sum(p.numel() for p in weights.parameters())
    for counts in run.field("comm_bytes").values():
        assert [(c or {}).get("dp", 0) for c in counts] == [ring if s % H == 0 else 0 for s in range(1, STEPS + 1)]


def test_a_diloco_checkpoint_exports_theta_outer(layouts, tmp_path):
    """`export-merged`/`export-hf` rebuild the model from a checkpoint: a diloco one holds each replica's weights
    under its own name (they differ mid-round) and theta_outer, the weights every replica takes at a sync; the
    export reads theta_outer, as DCP's own converter finds it in the files."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from workers.finetune import rebuilt_model

    dcp_to_torch_save(layouts["ckpt"], tmp_path / "whole.pt")
    saved = torch.load(tmp_path / "whole.pt", weights_only=False)
    outer, head = saved["diloco"]["outer"], "diloco_replica0."
    replica0 = {k[len(head):]: v for k, v in saved["model"].items() if k.startswith(head)}
    _, model = rebuilt_model(layouts["dp2"][0].worker_dict(), layouts["ckpt"])
    params = {name: p.detach() for name, p in model.named_parameters()}
    assert set(params) == set(outer) and all(torch.equal(params[n], outer[n]) for n in params)
    assert any(not torch.equal(outer[n], replica0[n]) for n in outer)  # saved mid-round: not replica 0's weights


@pytest.mark.parametrize(("parallel", "field"), [
    ({"dp_sync": "diloco", "dp": 2, "zero": 1}, "parallel.zero"),
    ({"dp_sync": "diloco", "dp": 2, "tp": 2}, "parallel.tp"),
    ({"dp_sync": "diloco", "dp": 1}, "parallel.dp"),
    ({"dp_sync": "diloco", "dp": 2, "grad_compression": "bf16"}, "parallel.grad_compression"),
    ({"dp": 2, "diloco_inner_steps": 4}, "parallel.diloco_inner_steps"),
    ({"dp_sync": "ps", "dp": 2, "diloco_outer_lr": 0.5}, "parallel.diloco_outer_lr"),
])
def test_diloco_refusals_name_the_field(token_data, tmp_path, parallel, field):
    with pytest.raises(SpecError) as err:
        tiny_spec(token_data, tmp_path, parallel=parallel)
    assert field in str(err.value)


def test_diloco_rolls_back_to_a_snapshot_mid_round_bit_for_bit(token_data, tmp_path):
    """A snapshot taken one step into a round (the replicas' weights differ) and restored after the outer step at 6
    (which moved theta_outer and its momentum): the replayed steps are the first ones exactly, which they are only
    if the snapshot carried the outer state too."""
    spec = _spec(token_data, tmp_path, 2).worker_dict()
    by_rank = spawn_ranks(replay_from_snapshot, (spec, rank_ports(1), 2, 4, STEPS - 4), 2, 300.0)
    for first, again in by_rank.values():
        assert again == first
