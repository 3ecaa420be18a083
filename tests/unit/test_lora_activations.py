"""LoRA's activation model: what autograd saves with a frozen base, predicted per block and checked in one process.

The Ray layouts (tp x pp, QLoRA under ZeRO-3) are in tests/test_memory_measured.py;
here ``ActivationMeter`` measures a single-process forward for target sets that
exercise each rule of ``memory_model.Frozen``: nothing saved upstream of the first
adapter, a frozen Linear saving nothing, adapters saving their input and rank-r output,
and NF4 bases saving no dequantised weight.
"""

from __future__ import annotations

import pytest
import torch

from orchestrator.planning.estimate import estimate, head_bytes, layer_bytes
from tests.support.jobs import tiny_spec
from workers.diagnostics.memory_probe import ActivationMeter
from workers.finetune import prepare_model
from workers.model.gpt import GPT, lm_loss
from workers.model.registry import model_config

WIDE = {"d_model": 128, "n_heads": 4, "d_ff": 128}
TARGETS = {
    "attention-and-mlp-and-head": ({}, ["wq", "wo", "w1", "w2", "output"]),
    "one-projection": ({}, ["wk"]),
    "one-late-layer": ({}, ["layers.2.*"]),
    "head-only": ({}, ["output"]),
    "qlora-all": (WIDE, ["wq", "wk", "wv", "wo", "w1", "w2"]),
}


@pytest.mark.parametrize("name", list(TARGETS))
def test_frozen_base_activations_match_the_probe(name, token_data, tmp_path):
    model, targets = TARGETS[name]
    lora = {"rank": 4, "targets": targets, "quantize": "nf4" if name.startswith("qlora") else None}
    spec = tiny_spec(token_data, tmp_path, model={**model, "lora": lora}, train={"microbatches": 1})
    torch.manual_seed(0)
    gpt = GPT(model_config(spec.worker_dict()["model"]))
    prepare_model(gpt, spec.model.lora)
    tokens = torch.randint(0, spec.model.vocab_size, (spec.train.global_batch_size, spec.model.seq_len))
    with ActivationMeter([gpt], []) as meter:
        loss = lm_loss(gpt(tokens), tokens)
    loss.backward()
    predicted = sum(layer_bytes(spec, i) for i in range(spec.model.n_layers)) + head_bytes(spec)
    assert abs(predicted - meter.peak) <= 0.01 * meter.peak, (predicted, meter.peak)
    # counted as a trained model (the model before frozen bases), the same job over-predicts by more than 10%
    trained = tiny_spec(token_data, tmp_path, model=model, train={"microbatches": 1})
    as_trained = sum(layer_bytes(trained, i) for i in range(spec.model.n_layers)) + head_bytes(trained)
    assert as_trained > 1.1 * meter.peak, (as_trained, meter.peak)


def test_zero3_gathered_leaves_nf4_bases_out(token_data, tmp_path):
    """FSDP2 all-gathers a QLoRA block's adapters and norms, not its NF4 buffers: the gathered term shrinks by
    exactly the full-precision bytes of two blocks' base weights against the same LoRA run without NF4."""
    par = {"dp": 2, "zero": 3, "tp": 2}
    lora = {"rank": 4}
    full, nf4 = (estimate(tiny_spec(token_data, tmp_path, parallel=par, model={**WIDE, "lora": {**lora, **q}}))[0]
                 for q in ({}, {"quantize": "nf4"}))
    block_base = 6 * 128 * 128 // 2  # wq, wk, wv, wo, w1, w2 at d = d_ff = 128, sharded over tp=2
    assert full.state.gathered - nf4.state.gathered == 4 * 2 * block_base
