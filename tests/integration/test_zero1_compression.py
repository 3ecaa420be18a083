"""PowerSGD and top-k at ZeRO-1 over real gloo ranks (dp=2), without Ray (tests/support/parity_harness.py).

At ZeRO-1 every rank still holds its whole gradient until the reduction, so ZeRO-0's compressed all-reduce (error
feedback per bucket) runs as it is and each rank keeps its slice of the approximated average
(``DistributedOptimizer.averaged``): the compressed all-reduce replaces the reduce-scatter. Checked as ZeRO-0's
kinds are (tests/integration/test_comm.py): the loss after 200 steps, the counted bytes, a bit-identical resume.
"""

from __future__ import annotations

import statistics

import pytest

from orchestrator.planning import comm_model as cm
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped, run_layouts
from tests.support.reference import reference_run
from workers.model.meta_init import build_full
from workers.model.registry import model_config

STEPS = 200
LAST = 10  # the loss compared is the mean of the last LAST steps (every run sees the same batches)
KINDS = {  # kind -> (parallel, the warm-up steps of its counted run)
    "powersgd": ({"grad_compression": "powersgd", "powersgd_rank": 4}, 10),
    "topk": ({"grad_compression": "topk", "topk_ratio": 0.2}, 0),
}
COMPRESSED = 2  # compressed steps counted after the warm-up


def _spec(token_data, tmp, name: str, steps: int, zero: int, parallel: dict | None = None, counted: bool = True):
    return tiny_spec(token_data, tmp / name, parallel={"dp": 2, "device": "cpu", "zero": zero, **(parallel or {})},
                     train={"steps": steps}, metrics={"comm_bytes": counted})


@pytest.fixture(scope="module")
def specs(token_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero1-compression")
    longest = max(w for _, w in KINDS.values()) + COMPRESSED
    out = {"zero1": _spec(token_data, tmp, "zero1", STEPS, 1, counted=False),
           "zero1-counted": _spec(token_data, tmp, "zero1-counted", longest, 1)}
    for kind, (parallel, warmup) in KINDS.items():
        out[kind] = _spec(token_data, tmp, kind, STEPS, 1, parallel, counted=False)
        for zero in (0, 1):
            out[f"{kind}-zero{zero}-counted"] = _spec(token_data, tmp, f"{kind}-{zero}", warmup + COMPRESSED, zero,
                                                      parallel)
    return out


@pytest.fixture(scope="module")
def runs(specs):
    return run_grouped(specs)


@pytest.mark.parametrize("kind", list(KINDS))
def test_zero1_compression_keeps_the_loss_within_5_percent_after_200_steps(kind, runs):
    """As ZeRO-0's kinds: the mean loss of the last 10 of 200 steps within 5% of uncompressed ZeRO-1's."""
    loss = statistics.fmean(ran(runs, kind).losses[-LAST:])
    assert loss == pytest.approx(statistics.fmean(ran(runs, "zero1").losses[-LAST:]), rel=0.05)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_compressed_all_reduce_replaces_the_reduce_scatter(kind, specs, runs):
    """Counted bytes per step and rank: plain ZeRO-1's step less its fp32 reduce-scatter ((N-1)/N of the
    gradient bytes, by the ring formula), plus ZeRO-0's compressed all-reduce of the same settings, exactly; and
    fewer than plain ZeRO-1 once compressing (during PowerSGD's warm-up the all-reduce is plain fp32)."""
    _, warmup = KINDS[kind]
    zero1, zero0 = (ran(runs, f"{kind}-zero{z}-counted").field("comm_bytes") for z in (1, 0))
    plain = ran(runs, "zero1-counted").field("comm_bytes")
    model = build_full(model_config(specs["zero1"].worker_dict()["model"]), 0)
    scatter = cm.reduce_scatter(sum(p.numel() * p.element_size() for p in model.parameters()), 2)
    for rank in (0, 1):
        sent, full = [s["dp"] for s in zero1[rank]], [s["dp"] for s in plain[rank][:len(zero1[rank])]]
        assert sent == [f - scatter + r["dp"] for f, r in zip(full, zero0[rank], strict=True)]
        assert all(s < f for s, f in zip(sent[warmup:], full[warmup:], strict=True))


def test_zero1_powersgd_warm_up_steps_match_the_reference(specs, runs):
    """The warm-up steps all-reduce plainly in fp32: ZeRO-1 with PowerSGD equals the single-process reference
    (1e-4) until its compression starts."""
    _, warmup = KINDS["powersgd"]
    spec, run = specs["powersgd-zero1-counted"], ran(runs, "powersgd-zero1-counted")
    losses, norms = reference_run(spec, warmup)
    assert run.losses[:warmup] == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms[:warmup] == pytest.approx(norms, rel=1e-4)


@pytest.fixture(scope="module")
def resumed(token_data, tmp_path_factory):
    """Per kind (no warm-up): the uninterrupted 4-step ZeRO-1 run and the run resumed from its step-2
    checkpoint."""
    tmp = tmp_path_factory.mktemp("zero1-resumed")
    specs, checkpoints, resumes, save_afters = [], [], [], []
    for kind, (parallel, _) in KINDS.items():
        spec = _spec(token_data, tmp, kind, 4, 1, {**parallel, "powersgd_warmup_steps": 0}
                     if kind == "powersgd" else parallel)
        ckpt = str(tmp / kind / "ckpt")
        specs += [spec.worker_dict()] * 2
        checkpoints += [ckpt, None]
        resumes += [None, ckpt]
        save_afters += [2, None]
    out = run_layouts(specs, 2, [4] * len(specs), checkpoints=checkpoints, resumes=resumes, save_afters=save_afters)
    return {kind: (out[2 * i], out[2 * i + 1]) for i, kind in enumerate(KINDS)}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_zero1_compressed_run_resumes_bit_identically_with_its_error_feedback(kind, resumed):
    whole, again = resumed[kind]
    assert again.losses[:2] == whole.losses[2:] and again.grad_norms[:2] == whole.grad_norms[2:]
