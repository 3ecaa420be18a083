"""`optim.state_dtype: bf16`: AdamW's moments stored in bfloat16 train as float32's do, keep their dtype through
state dicts, checkpoints and resharding, resume bit-identically, are refused where another path would step them,
and are counted at half the bytes by the planner.

The runs: the tiny job at dp=2 over FSDP2 (ZeRO-3: the moments are DTensor shards) for 40 steps with fp32 and with
bf16 moments, the bf16 run saving after 20 steps, and that checkpoint resumed at ZeRO-3 (bit-identical to the
uninterrupted run) and at ZeRO-1 (resharded to flat slices), in one spawn of 2 gloo ranks (no Ray).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orchestrator.errors import SpecError
from orchestrator.planning import estimate
from orchestrator.planning import memory_model as mm
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts
from workers.contract.sections import OptimSection
from workers.optim.build import build_optimizer

STEPS, SAVED_AT = 40, 20


def _params() -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(16, 8, generator=gen)), nn.Parameter(torch.randn(8, generator=gen))]


def _train(optim: OptimSection, steps: int = 5) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    """``_params()`` after ``steps`` steps of the job's optimizer on the same seeded gradients."""
    params, gen = _params(), torch.Generator().manual_seed(1)
    opt = build_optimizer(params, optim)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_bf16_moments_step_like_pytorchs_optimizer_and_keep_their_dtype(name):
    optim = {"name": name, "weight_decay": 0.1, "lr": 1e-2}
    low, opt = _train(OptimSection(**optim, state_dtype="bf16"))
    full, ref = _train(OptimSection(**optim, implementation="for_loop"))
    held = [opt.state[p][k] for p in low for k in ("exp_avg", "exp_avg_sq")]
    assert {t.dtype for t in held} == {torch.bfloat16}
    assert {ref.state[p]["exp_avg"].dtype for p in full} == {torch.float32}
    for a, b in zip(low, full):  # the same update, the moments rounded to bf16's 8 bits
        assert torch.allclose(a, b, rtol=0, atol=2e-3) and not torch.equal(a, b)
    again = build_optimizer(low, OptimSection(**optim, state_dtype="bf16"))
    again.load_state_dict(opt.state_dict())  # torch casts loaded state to the parameter's dtype; it is cast back
    for p in low:
        for k in ("exp_avg", "exp_avg_sq"):
            assert again.state[p][k].dtype == torch.bfloat16 and torch.equal(again.state[p][k], opt.state[p][k])


REFUSED = {  # fields over the tiny job: the field the error names
    "sgd": ({"optim": {"name": "sgd"}}, "optim.name"),
    "offloaded": ({"memory": {"offload": {"optimizer": True}}}, "memory.offload.optimizer"),
    "fused": ({"optim": {"implementation": "foreach"}}, "optim.implementation"),
    "ps": ({"parallel": {"dp": 2, "dp_sync": "ps"}}, "parallel.dp_sync"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_bf16_state_is_refused_where_another_path_steps_the_moments(case, token_data, tmp_path):
    sections, field = REFUSED[case]
    sections = {k: dict(v) for k, v in sections.items()}
    sections["optim"] = {**sections.get("optim", {}), "state_dtype": "bf16"}
    with pytest.raises(SpecError, match=rf"{field}.*optim.state_dtype bf16.*fp32"):
        tiny_spec(token_data, tmp_path, **sections)


def test_the_planner_counts_bf16_moments_at_half_the_bytes(token_data, tmp_path):
    n = 1_000_000
    assert mm.model_state(n, optimizer="adamw").optimizer == 8 * n
    assert mm.model_state(n, optimizer="adamw", state_dtype="bf16").optimizer == 4 * n
    assert mm.model_state(n, precision="mixed", optimizer="adam", state_dtype="bf16").optimizer == 8 * n  # + master
    plans = {d: estimate.estimate(tiny_spec(token_data, tmp_path, optim={"state_dtype": d})) for d in ("fp32", "bf16")}
    fp32, bf16 = (plans[d][0].state.optimizer for d in ("fp32", "bf16"))
    assert bf16 * 2 == fp32 > 0


def _spec(token_data, tmp_path, name: str, state_dtype: str, zero: int) -> dict:
    return tiny_spec(token_data, tmp_path / name, parallel={"dp": 2, "zero": zero},
                     optim={"state_dtype": state_dtype}, train={"steps": STEPS}).worker_dict()


@pytest.fixture(scope="module")
def runs(token_data, tmp_path_factory):
    """fp32 and bf16 for 40 steps; bf16 saved after 20 and resumed at ZeRO-3 and ZeRO-1 for the last 20."""
    tmp = tmp_path_factory.mktemp("state_dtype")
    saved = str(tmp / "saved")
    specs = [_spec(token_data, tmp, "fp32", "fp32", 3), _spec(token_data, tmp, "bf16", "bf16", 3),
             _spec(token_data, tmp, "resumed", "bf16", 3), _spec(token_data, tmp, "resharded", "bf16", 1)]
    out = run_layouts(specs, 2, [STEPS, STEPS, STEPS - SAVED_AT, STEPS - SAVED_AT],
                      checkpoints=[None, saved, None, None], resumes=[None, None, saved, saved],
                      save_afters=[None, SAVED_AT, None, None])
    return dict(zip(("fp32", "bf16", "resumed", "resharded"), out))


def test_forty_steps_with_bf16_moments_end_within_one_percent_of_fp32(runs):
    fp32, bf16 = runs["fp32"].losses, runs["bf16"].losses
    assert len(bf16) == STEPS and fp32[-1] < 0.8 * fp32[0]  # it trained
    assert bf16[-1] == pytest.approx(fp32[-1], rel=0.01)
    assert bf16 != fp32  # the moments were rounded: not the fp32 run under another name


def test_bf16_moments_resume_bit_identically_and_reshard(runs):
    tail = runs["bf16"].losses[SAVED_AT:]
    assert runs["resumed"].losses == tail
    assert runs["resumed"].grad_norms == runs["bf16"].grad_norms[SAVED_AT:]
    assert runs["resharded"].losses == pytest.approx(tail, rel=1e-4)  # ZeRO-1's reduction rounds differently
