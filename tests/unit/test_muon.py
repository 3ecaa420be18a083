"""`optim.name: muon`: one step of the hybrid is PyTorch's Muon over the blocks' matrices and AdamW over the rest,
by hand; the partition is the docstring's (embeddings, head, norms not in Muon); a checkpoint of a muon run resumes
bit-identically; and the spec refuses the layouts Muon cannot step whole matrices on, and Muon's knobs elsewhere."""

from __future__ import annotations

import copy

import pytest
import torch

from orchestrator.spec import JobSpec
from tests.support.jobs import TINY
from tests.support.one_rank import one_rank_trainer
from tests.support.spec_errors import assert_actionable, spec_error
from workers.model.gpt import lm_loss
from workers.model.meta_init import build_full
from workers.model.registry import model_config
from workers.optim.build import build_optimizer
from workers.optim.muon import muon_owns
from workers.spec import WorkerSpec

MUON = {"name": "muon", "lr": 0.01, "weight_decay": 0.1, "muon_momentum": 0.9, "muon_ns_steps": 4}
# the tiny GPT's hidden matrices, listed rather than derived: what Muon must step and nothing else
BLOCK_MATRICES = {f"layers.{i}.{m}.weight" for i in range(TINY["model"]["n_layers"])
                  for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                            "feed_forward.w1", "feed_forward.w2")}


def _raw(**optim) -> dict:
    raw = copy.deepcopy(TINY)
    raw["data"] = {"path": "/tmp"}
    raw["optim"] = {**MUON, **optim}
    return raw


def _model_and_optim():
    worker = JobSpec.from_dict(_raw()).worker_dict()
    return build_full(model_config(worker["model"]), 0), WorkerSpec.from_dict(worker).optim


def _backward(model: torch.nn.Module, seed: int) -> None:
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(seed))
    lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()


def test_one_step_is_torch_muon_on_the_block_matrices_and_adamw_on_the_rest():
    model, optim = _model_and_optim()
    by_hand = copy.deepcopy(model)
    named = list(model.named_parameters())
    hybrid = build_optimizer([p for _, p in named], optim, names=[n for n, _ in named])
    muon_part, adamw_part = hybrid.optimizers
    names = {id(p): n for n, p in named}
    assert {names[id(p)] for g in muon_part.param_groups for p in g["params"]} == BLOCK_MATRICES
    rest = {names[id(p)] for g in adamw_part.param_groups for p in g["params"]}
    assert {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.attention_norm.weight"} <= rest
    assert rest == {n for n, _ in named} - BLOCK_MATRICES

    hand = dict(by_hand.named_parameters())
    matrices = [hand[n] for n in sorted(BLOCK_MATRICES)]
    others = [p for n, p in hand.items() if n not in BLOCK_MATRICES]
    muon = torch.optim.Muon(matrices, lr=0.01, weight_decay=0.1, momentum=0.9, nesterov=True, ns_steps=4,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [p for p in others if p.dim() >= 2], "weight_decay": 0.1},
                               {"params": [p for p in others if p.dim() < 2], "weight_decay": 0.0}],
                              lr=0.01, betas=(0.9, 0.95))
    for step in range(2):  # the second step reads the momentum the first one left
        for m, opts in ((model, [hybrid]), (by_hand, [muon, adamw])):
            _backward(m, step)
            for opt in opts:
                opt.step()
                opt.zero_grad()
    for n, p in model.named_parameters():
        assert torch.equal(p, hand[n]), n
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), build_full(model.cfg, 0).parameters()))


def test_lora_adapters_are_left_to_adamw():
    """An adapter is 2-D inside a block, yet not Muon's: its factor is not the layer's update."""
    from workers.model.lora import LoRALinear

    layer = LoRALinear(torch.nn.Linear(16, 16, bias=False), 16, 16, rank=4, alpha=8.0, dropout=0.0)
    named = dict(layer.named_parameters(prefix="layers.0.attention.wq"))
    assert {n for n, p in named.items() if muon_owns(n, p)} == {"layers.0.attention.wq.base.weight"}


def test_a_muon_run_resumes_from_its_checkpoint_bit_identically(tmp_path_factory, tmp_path):
    optim = {k: v for k, v in MUON.items()}
    with one_rank_trainer(tmp_path_factory, optim=optim, train={"steps": 4}) as t:
        for _ in range(2):
            t.train_step()
        t.checkpoints.save(tmp_path / "ckpt", async_save=False)
        straight = [t.train_step().loss for _ in range(2)]
        weights = {n: p.detach().clone() for n, p in t.parts.modules[0].named_parameters()}
    with one_rank_trainer(tmp_path_factory, optim=optim, train={"steps": 4}) as t:
        t.checkpoints.load(tmp_path / "ckpt")
        muon = t.state.optimizers[0].optimizers[0]
        assert all(s["momentum_buffer"].abs().sum() > 0 for s in muon.state.values())  # the momentum came back
        resumed = [t.train_step().loss for _ in range(2)]
        assert resumed == straight
        for n, p in t.parts.modules[0].named_parameters():
            assert torch.equal(p, weights[n]), n


def test_an_fp16_step_that_overflows_leaves_muon_and_adamw_untouched(tmp_path_factory):
    """Loss scaling at 2**18: step 1 applies, step 2 overflows (skipped on every rank: the check is all-reduced),
    step 3 applies at the halved scale. The skipped step moves no weight and no Muon buffer or AdamW moment."""
    with one_rank_trainer(tmp_path_factory, optim=dict(MUON), train={"steps": 3},
                          precision={"dtype": "fp16", "initial_loss_scale": 2.0**18}) as t:
        model, hybrid = t.parts.modules[0], t.state.optimizers[0]

        def snapshot():
            return ({n: p.detach().clone() for n, p in model.named_parameters()},
                    [{k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for s in hybrid.state.values()])

        assert t.train_step().grad_norm > 0
        weights, states = snapshot()
        assert len(states) == len(list(model.parameters()))  # both parts stepped every parameter
        skipped = t.train_step()
        assert skipped.grad_norm != skipped.grad_norm  # NaN: the overflow
        after_weights, after_states = snapshot()
        assert all(torch.equal(after_weights[n], w) for n, w in weights.items())
        assert all(torch.equal(a[k], b[k]) for a, b in zip(after_states, states) for k in b)
        assert t.train_step().grad_norm > 0
        assert any(not torch.equal(p, weights[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("sections, field, value, fix", [
    ({"parallel": {"dp": 2, "zero": 1}}, "parallel.zero", 1, "zero: 2 or 3"),
    ({"parallel": {"dp_sync": "ps"}, "parameter_server": {"optimizer": "adamw"}}, "parallel.dp_sync", "ps",
     "allreduce"),
    ({"memory": {"offload": {"optimizer": True}}}, "memory.offload.optimizer", True, "false"),
    ({"model": {"lora": {"rank": 4}}}, "model.lora", "set", "optim.name: adamw"),
])
def test_muon_is_refused_where_it_cannot_step_whole_matrices_or_would_step_none(sections, field, value, fix):
    raw = _raw()
    for name, fields in sections.items():
        raw.setdefault(name, {}).update(fields)
    assert_actionable(spec_error(raw), field, value, fix)


@pytest.mark.parametrize("knob, value", [("muon_momentum", 0.9), ("muon_nesterov", False), ("muon_ns_steps", 3)])
def test_muon_knobs_are_refused_with_another_optimizer(knob, value):
    raw = _raw(name="adamw", **{knob: value})
    for k in ("muon_momentum", "muon_ns_steps"):
        if k != knob:
            raw["optim"].pop(k)
    assert_actionable(spec_error(raw), f"optim.{knob}", value, "optim.name: muon")


def test_the_planner_counts_one_buffer_per_block_matrix_and_adams_two_moments_elsewhere():
    """Muon's state is one fp32 buffer per block matrix; the AdamW part (here the embedding and head, and the norms
    within the blocks' count) keeps two moments."""
    from orchestrator.planning.estimate import estimate

    plain = _raw(name="adamw")
    plain["optim"] = {k: v for k, v in plain["optim"].items() if not k.startswith("muon_")}
    muon, adamw = (estimate(JobSpec.from_dict(raw))[0] for raw in (_raw(), plain))
    cfg = TINY["model"]
    blocks = cfg["n_layers"] * (4 * cfg["d_model"] ** 2 + 2 * cfg["d_model"] * cfg["d_ff"])  # BLOCK_MATRICES' sizes
    assert adamw.state.optimizer - muon.state.optimizer == pytest.approx(4 * blocks, rel=0.02)
