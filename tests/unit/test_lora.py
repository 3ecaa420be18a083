"""LoRA/QLoRA in one process: what trains, what stays frozen, the merge, and the job-file errors."""

from __future__ import annotations

import pytest
import torch

from orchestrator import JobSpec
from orchestrator.errors import SpecError
from orchestrator.spec.lora import check_base_checkpoint, parameter_split
from tests.support.jobs import tiny_spec
from tests.support.lora import base_and_lora
from workers.data import DataCursor, TokenDataset
from workers.model.gpt import GPT, lm_loss
from workers.model.lora import LoRALinear, merged_state_dict
from workers.model.nf4 import NF4Linear
from workers.model.registry import model_config


def train(model: GPT, spec: JobSpec, steps: int, weight_decay: float = 0.1) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=weight_decay)
    cursor = DataCursor(TokenDataset(spec.data.path, spec.model.seq_len, 0), spec.train.global_batch_size, 0, 1)
    losses = []
    for _ in range(steps):
        x, y = cursor.next_batch()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_only_adapters_train_and_the_base_stays_bit_identical(token_data, tmp_path, quantize):
    spec = tiny_spec(token_data, tmp_path, model={"lora": {"rank": 4, "quantize": quantize}})
    base, model = base_and_lora(spec)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.rsplit(".", 2)[-2] in ("lora_a", "lora_b") for n in trainable)
    x = torch.randint(0, 256, (2, 32))
    if quantize is None:  # B = 0: step 0 is exactly the base model
        assert torch.equal(model(x), base(x))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    frozen |= {n: b.clone() for n, b in model.named_buffers()}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    losses = train(model, spec, steps=5)  # weight decay on: frozen weights must not even decay
    assert all(torch.equal(t, dict(model.named_parameters()).get(n, dict(model.named_buffers()).get(n)))
               for n, t in frozen.items())
    assert all(not torch.equal(p, adapters[n]) for n, p in model.named_parameters() if n.endswith("lora_b.weight"))
    assert losses[-1] < losses[0]


def test_nf4_base_is_what_qlora_quantizes(token_data, tmp_path):
    spec = tiny_spec(token_data, tmp_path, model={"lora": {"quantize": "nf4", "targets": ["w1", "w2"]}})
    _, model = base_and_lora(spec)
    adapted = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(adapted) == 2 * spec.model.n_layers and all(isinstance(m.base, NF4Linear) for m in adapted)
    assert isinstance(model.layers["0"].attention.wq, torch.nn.Linear)  # untargeted layers stay full precision


def test_qlora_fine_tune_lowers_the_loss(token_data, tmp_path):
    targets = ["wq", "wk", "wv", "wo", "w1", "w2", "output"]  # a random base: the head must adapt too
    spec = tiny_spec(token_data, tmp_path, model={"lora": {"rank": 8, "quantize": "nf4", "targets": targets}})
    losses = train(base_and_lora(spec)[1], spec, steps=16, weight_decay=0.0)  # past a spike lr 1e-2 gives at step 9
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses


def test_merged_weights_are_base_plus_scaled_ba(token_data, tmp_path):
    spec = tiny_spec(token_data, tmp_path, model={"lora": {"rank": 4, "alpha": 8.0, "targets": ["wq", "w2", "output"]}})
    base, model = base_and_lora(spec)
    torch.manual_seed(1)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            torch.nn.init.normal_(m.lora_b.weight)  # a trained-looking B
    merged = merged_state_dict(model)
    layer = model.layers["1"].feed_forward.w2
    expected = base.layers["1"].feed_forward.w2.weight + (8.0 / 4) * layer.lora_b.weight @ layer.lora_a.weight
    assert torch.allclose(merged["layers.1.feed_forward.w2.weight"], expected, atol=1e-6)
    plain = GPT(model_config(spec.worker_dict()["model"]))
    plain.load_state_dict(merged)  # strict: exactly the plain model's names
    x = torch.randint(0, 256, (2, 32))
    assert torch.allclose(plain(x), model(x), atol=1e-4)


def _lora_job(**lora) -> dict:
    return {"data": {"path": "d"}, "model": {"d_model": 32, "n_heads": 4, "d_ff": 64, "n_layers": 2, "lora": lora}}


@pytest.mark.parametrize("job, field, words", [
    (_lora_job(rank=0), "model.lora.rank", "> 0"),
    (_lora_job(targets=["wq", "q_proj"]), "model.lora.targets[1]", "matches no Linear"),
    (_lora_job(targets=[]), "model.lora.targets", "at least 1"),
    (_lora_job(quantize="nf8"), "model.lora.quantize", "nf4"),
    (_lora_job(quantize="nf4", targets=["output"]) | {"model": {**_lora_job()["model"], "vocab_size": 257,
                                                                 "lora": {"quantize": "nf4", "targets": ["output"]}}},
     "model.lora.quantize", "blocks of 64"),
    (_lora_job(quantize="nf4") | {"parallel": {"tp": 2}}, "model.lora.quantize", "multiple of 128"),
    (_lora_job(dropout=0.1) | {"parallel": {"tp": 2}}, "model.lora.dropout", "dropout: 0"),
])
def test_bad_lora_settings_name_field_value_and_fix(job, field, words):
    with pytest.raises(SpecError) as err:
        JobSpec.from_dict(job)
    assert err.value.field == field and "fix:" in str(err.value) and words in str(err.value)


def test_missing_base_checkpoint_is_refused_before_start(tmp_path):
    spec = JobSpec.from_dict(_lora_job(base_checkpoint=str(tmp_path / "nope")))
    with pytest.raises(SpecError, match="model.lora.base_checkpoint.*fix: point it at one step directory"):
        check_base_checkpoint(spec)


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_parameter_split_for_memory_estimates_matches_the_built_model(token_data, tmp_path, quantize):
    spec = tiny_spec(token_data, tmp_path, model={"lora": {"rank": 4, "quantize": quantize, "targets": ["wq", "w1"]}})
    _, model = base_and_lora(spec)
    split = parameter_split(spec)
    assert split["trainable"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert split["frozen"] == sum(p.numel() for p in model.parameters() if not p.requires_grad)
    nf4 = [m.base for m in model.modules() if isinstance(m, LoRALinear) and isinstance(m.base, NF4Linear)]
    assert split["nf4"] == sum(m.in_features * m.out_features for m in nf4)
