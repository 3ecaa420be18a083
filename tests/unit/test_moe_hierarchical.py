"""The hierarchical (two-level) MoE router (``router: hierarchical``; seed 001 line 141, Shazeer et al. 2017):
its assignments, gates and importance loss equal a float64 reference written out token by token here; a tiny
model trained with it at dp=2 × ep=2 follows the single-process curve (parity harness, no Ray); the spec refuses
groups that do not split the experts."""

from __future__ import annotations

import pytest
import torch

from orchestrator import JobSpec
from orchestrator.errors import SpecError
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layout
from tests.support.reference import reference_run
from workers.model.config import MoEConfig
from workers.model.moe import HierarchicalRouter

EXPERTS, GROUPS, D = 8, 4, 6


def _router(group_top_k: int, top_k: int, aux: float = 0.01) -> HierarchicalRouter:
    cfg = MoEConfig(experts=EXPERTS, router="hierarchical", expert_groups=GROUPS, group_top_k=group_top_k,
                    top_k=top_k, aux_loss_weight=aux)
    router = HierarchicalRouter(cfg, D)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.normal_(0, 1, generator=gen)
        router.group_weight.normal_(0, 1, generator=gen)
    return router


def _reference(router: HierarchicalRouter, x: torch.Tensor, group_top_k: int, top_k: int):
    """Per token, in float64: the chosen groups by the group gate, softmax over their logits; in each, its top_k
    experts by that group's own gate, softmax over theirs; gate = product. Returns ({(token, expert): gate},
    the importance loss w·(CV²(Σ group gates) + CV²(Σ expert gates)) averaged over routing groups)."""
    w_group, w_expert = router.group_weight.detach().double(), router.weight.detach().double()
    size = EXPERTS // GROUPS
    assigned, losses = {}, []
    for gi, group in enumerate(x.double()):
        group_sum, expert_sum = torch.zeros(GROUPS, dtype=torch.float64), torch.zeros(EXPERTS, dtype=torch.float64)
        for t, token in enumerate(group):
            first = (w_group @ token).topk(group_top_k)
            for group_gate, i in zip(first.values.softmax(0), first.indices.tolist(), strict=True):
                group_sum[i] += group_gate
                own = w_expert[i * size:(i + 1) * size] @ token  # group i's gate
                second = own.topk(top_k)
                for expert_gate, j in zip(second.values.softmax(0), second.indices.tolist(), strict=True):
                    assigned[(gi * len(group) + t, i * size + j)] = float(group_gate * expert_gate)
                    expert_sum[i * size + j] += group_gate * expert_gate
        cv2 = [float(v.var(unbiased=False) / v.mean() ** 2) for v in (group_sum, expert_sum)]
        losses.append(sum(cv2))
    return assigned, router.cfg.aux_loss_weight * sum(losses) / len(losses)


@pytest.mark.parametrize("group_top_k, top_k", [(1, 1), (1, 2), (2, 2), (4, 1)])
def test_assignments_gates_and_loss_equal_the_float64_reference(group_top_k, top_k):
    router = _router(group_top_k, top_k)
    x = torch.randn(3, 10, D, generator=torch.Generator().manual_seed(group_top_k * 10 + top_k))
    routing = router(x, None)
    got = {(t, e): g for t, e, g in zip(routing.token.tolist(), routing.expert.tolist(), routing.gate.tolist(),
                                        strict=True)}
    want, loss = _reference(router, x, group_top_k, top_k)
    assert got.keys() == want.keys()
    assert all(abs(got[key] - want[key]) < 1e-6 for key in want)
    assert float(routing.losses["importance"].detach()) == pytest.approx(loss, rel=1e-5)
    gate_sums = torch.zeros(30).index_add_(0, routing.token, routing.gate)
    assert torch.allclose(gate_sums, torch.ones(30), atol=1e-6)  # a token's gates sum to one
    assert routing.token.numel() == 30 * group_top_k * top_k  # dropless


def test_both_gates_learn():
    router = _router(2, 2)
    routing = router(torch.randn(2, 8, D), None)
    (routing.gate.square().sum() + routing.losses["importance"]).backward()
    assert router.weight.grad.abs().sum() > 0 and router.group_weight.grad.abs().sum() > 0


MOE = {"experts": 4, "router": "hierarchical", "expert_groups": 2, "top_k": 1, "group_top_k": 2}


def test_a_model_trains_with_it_at_dp2_ep2_on_the_single_process_curve(token_data, tmp_path):
    def spec(parallel):
        return tiny_spec(token_data, tmp_path, model={"n_layers": 2, "moe": MOE},
                         parallel={**parallel, "device": "cpu"}, train={"steps": 3, "microbatches": 1})

    losses, grad_norms = reference_run(spec({}), 3)
    run = run_layout(spec({"dp": 2, "ep": 2}).worker_dict(), 2, 3)
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("moe, field, fix", [
    ({"router": "hierarchical", "experts": 8}, "expert_groups", "divisor of experts"),
    ({"router": "hierarchical", "experts": 8, "expert_groups": 3}, "expert_groups", "divisor of experts"),
    ({"router": "hierarchical", "experts": 8, "expert_groups": 4, "group_top_k": 5}, "group_top_k", "at most 4"),
    ({"router": "hierarchical", "experts": 8, "expert_groups": 4, "top_k": 3}, "top_k", "at most 2"),
    ({"router": "topk", "expert_groups": 2}, "expert_groups", "router: hierarchical"),
])
def test_spec_refuses_groups_that_do_not_fit(moe, field, fix, tmp_path):
    with pytest.raises(SpecError, match=rf"model\.moe\.{field}.*{fix}"):
        JobSpec.from_dict({"data": {"path": str(tmp_path)}, "model": {"moe": moe}})
