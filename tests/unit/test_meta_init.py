"""Meta-device init in one process: per-parameter values independent of how the model is cut and sharded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.jobs import tiny_spec
from workers.contract.sections import LoraSection
from workers.model import meta_init
from workers.model.config import ModelConfig
from workers.model.gpt import GPT
from workers.model.meta_init import build_full, materialize
from workers.model.names import parameter_generator
from workers.model.nf4 import NF4Linear, quantize
from workers.parallel.gpt_parallel import cut_stage
from workers.parallel.parallelize import build_parts
from workers.spec import WorkerSpec

CFG = ModelConfig(d_model=64, n_layers=4, n_heads=4, d_ff=128, seq_len=16)
LORA = LoraSection(rank=4, alpha=8.0, targets=["wq", "w2"])


def test_a_cut_stage_materialised_on_its_own_equals_that_slice_of_the_whole_model():
    whole = build_full(CFG, seed=7)
    with torch.device("meta"):
        stage = cut_stage(GPT(CFG), 1, 2)
    materialize(stage, 7, CFG, torch.device("cpu"))
    for name, p in stage.named_parameters():
        assert torch.equal(p, whole.get_parameter(name)), name
    assert stage.tok_embeddings is None and set(stage.layers) == {"2", "3"}


def test_values_depend_on_seed_and_name_only():
    a, b, c = build_full(CFG, seed=7), build_full(CFG, seed=7), build_full(CFG, seed=8)
    assert all(torch.equal(p, b.get_parameter(n)) for n, p in a.named_parameters())
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)
    assert not torch.equal(a.layers["0"].attention.wq.weight, a.layers["1"].attention.wq.weight)
    torch.manual_seed(7)  # GPT(cfg) draws from the last manual_seed, through the same hook
    assert torch.equal(GPT(CFG).output.weight, a.output.weight)
    assert torch.equal(a.norm.weight, torch.ones(64))  # norms start at one, residual projections scaled down
    assert a.layers["0"].feed_forward.w2.weight.std() < a.layers["0"].feed_forward.w1.weight.std() / 2


@pytest.mark.parametrize("quantize_base", [None, "nf4"])
def test_lora_on_meta_equals_lora_on_a_materialised_model(quantize_base):
    lora = LORA.model_copy(update={"quantize": quantize_base})
    meta = build_full(CFG, seed=3, lora=lora)
    eager = build_full(CFG, seed=3)
    from workers.model.lora import apply_lora

    apply_lora(eager, lora, seed=3)
    for name, p in meta.named_parameters():
        assert torch.equal(p, eager.get_parameter(name)), name
    for name, b in meta.named_buffers():
        assert torch.equal(b, eager.get_buffer(name)), name
    assert torch.equal(meta.layers["0"].attention.wq.lora_b.weight, torch.zeros(64, 4))


def test_nf4_is_quantised_from_the_full_weight_then_cut_to_the_recorded_shard():
    weight = torch.randn(128, 64, generator=parameter_generator(0, "w"))
    with torch.device("meta"):
        layer = NF4Linear(nn.Linear(64, 128, bias=False))
    layer.shard_(0, 1, 2)
    layer.to_empty(device="cpu")
    layer.requantize(weight)
    assert torch.equal(layer.weight_nf4().dequantize(), quantize(weight).dequantize()[64:])


def test_tied_weights_stay_tied_and_buffers_without_a_reset_are_refused():
    with torch.device("meta"):
        tied = GPT(CFG)
    tied.output.weight = tied.tok_embeddings.weight
    materialize(tied, 1, CFG, torch.device("cpu"))
    assert tied.output.weight is tied.tok_embeddings.weight
    with torch.device("meta"):
        odd = GPT(CFG)
    odd.layers["0"].register_buffer("table", torch.empty(4, device="meta"))
    with pytest.raises(NotImplementedError, match=r"layers.0 \(Block\) holds buffers but has no reset_buffers"):
        materialize(odd, 1, CFG, torch.device("cpu"))


class _Axis:
    def get_local_rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_the_builder_materialises_only_meta_stages(tmp_path, monkeypatch, recompute):
    seen = []

    def spy(module, seed, cfg, device):
        seen.append(all(p.is_meta for p in module.parameters()))
        return materialize(module, seed, cfg, device)

    monkeypatch.setattr("workers.parallel.parallelize.materialize", spy)
    job = tiny_spec(tmp_path, tmp_path, train={"seed": 5}, memory={"recompute": recompute})
    spec = WorkerSpec.from_dict(job.worker_dict())
    (stage,) = build_parts(spec, {"pp": _Axis(), "dp": _Axis()}, torch.device("cpu")).modules
    assert seen == [True]
    whole = meta_init.build_full(spec.model, 5)
    assert all(torch.equal(p, whole.get_parameter(n)) for n, p in stage.named_parameters())
    x = torch.randint(0, 256, (2, 16))
    stage(x).sum().backward()  # the recompute wrappers, applied on meta, still run
    whole(x).sum().backward()
    assert all(torch.allclose(p.grad, whole.get_parameter(n).grad) for n, p in stage.named_parameters())
