"""LoRA/QLoRA through real Ray jobs: parity with the single-process reference, fine-tuning from a
base checkpoint, exact resume, frozen base on disk, and the merged export (QLoRA under tp=2: its parity only,
in the Ray-free harness)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orchestrator import TrainingJob
from orchestrator.cli import main
from tests.support.jobs import tiny_spec
from tests.support.lora import base_and_lora
from tests.support.parity_harness import run_spec
from tests.support.reference import reference_run
from workers.finetune import load_dcp_model
from workers.model.gpt import GPT
from workers.model.lora import LoRALinear
from workers.model.registry import model_config

STEPS = 5
LORA = {"rank": 4, "alpha": 8.0}

LAYOUTS = {
    "dp2-zero3": ({"dp": 2, "zero": 3}, {}),
}  # tp2-sp and pp2-dp2-zero-bubble run without Ray in tests/integration/test_parity_harness.py


def run(spec, resume=False):
    return TrainingJob(spec, resume=resume, progress=False).run()


def assert_resumes_exactly(spec, straight, from_step: int) -> None:
    """Un-complete the run's last checkpoint, resume from the one before: the losses must not change."""
    Path(straight.checkpoints[-1], ".metadata").unlink()
    resumed = run(spec, resume=True)
    assert resumed.resumed_from.endswith(f"step-{from_step:08d}")
    assert resumed.losses == straight.losses[from_step:]  # bit-identical


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layout_matches_single_process_reference(name, ray_cluster, token_data, tmp_path):
    parallel, lora = LAYOUTS[name]
    spec = tiny_spec(token_data, tmp_path, parallel={**parallel, "device": "cpu"},
                     model={"lora": {**LORA, **lora}}, train={"steps": STEPS})
    losses, grad_norms = reference_run(spec, STEPS)
    result = run(spec)
    assert result.losses == pytest.approx(losses, rel=1e-4)
    assert result.grad_norms == pytest.approx(grad_norms, rel=1e-4)


def test_qlora_matches_the_reference_and_resumes_exactly(ray_cluster, token_data, tmp_path):
    """The NF4 base is not checkpointed: a resumed run rebuilds it from the seed, bit for bit."""
    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 2, "zero": 3, "device": "cpu"},
                     model={"lora": {**LORA, "quantize": "nf4"}}, train={"steps": STEPS}, checkpoint={"every": 3})
    losses, grad_norms = reference_run(spec, STEPS)
    straight = run(spec)
    assert straight.losses == pytest.approx(losses, rel=1e-4)
    assert straight.grad_norms == pytest.approx(grad_norms, rel=1e-4)
    assert_resumes_exactly(spec, straight, from_step=3)


def test_qlora_tensor_parallel_matches_the_reference(token_data, tmp_path):
    """NF4 quantized whole, then sharded in whole blocks (column- and row-parallel bases, sequence parallel):
    the same dequantized weights as one process. Widths are multiples of 64 * tp, as the spec requires. In the
    Ray-free harness: the quantized layers live in the ranks (the Ray jobs above carry QLoRA through the
    controller, its checkpoints and resume)."""
    model = {"d_model": 128, "n_heads": 4, "d_ff": 128, "n_layers": 2,
             "lora": {**LORA, "quantize": "nf4", "targets": ["wq", "wk", "wv", "wo", "w1", "w2", "output"]}}
    spec = tiny_spec(token_data, tmp_path, parallel={"tp": 2, "device": "cpu"}, model=model,
                     train={"steps": STEPS})
    losses, grad_norms = reference_run(spec, STEPS)
    result = run_spec(spec)
    assert result.losses == pytest.approx(losses, rel=1e-4)
    assert result.grad_norms == pytest.approx(grad_norms, rel=1e-4)


def test_fine_tune_from_a_base_checkpoint_resume_and_export(ray_cluster, token_data, tmp_path):
    # 1. a full pre-training run leaves a base checkpoint
    pre = tiny_spec(token_data, tmp_path / "pre", parallel={"dp": 2, "zero": 2}, train={"steps": 4},
                    checkpoint={"every": 4})
    base_ckpt = run(pre).checkpoints[-1]
    # 2. LoRA from it at another layout (DCP reshards the base), checkpointing every 3 of 6 steps
    lora = {**LORA, "base_checkpoint": base_ckpt, "targets": ["wq", "wv", "w2", "output"]}
    spec = tiny_spec(token_data, tmp_path / "ft", parallel={"tp": 2}, model={"lora": lora},
                     train={"steps": 6, "seed": 7}, checkpoint={"every": 3})
    losses, _ = reference_run(spec, 6)
    straight = run(spec)
    assert straight.losses == pytest.approx(losses, rel=1e-4)
    pretrained = GPT(model_config(spec.worker_dict()["model"]))
    load_dcp_model(pretrained, base_ckpt)
    random_base = tiny_spec(token_data, tmp_path / "r", train={"seed": 7})
    assert reference_run(random_base, 1)[0][0] > straight.losses[0] + 0.1  # it starts from the trained base

    # 3. resume from step 3 continues exactly as the uninterrupted run
    assert_resumes_exactly(spec, straight, from_step=3)

    # 4. on disk: the base is bit-identical to the pre-trained weights, the adapters moved
    tuned = base_and_lora(spec)[1]
    load_dcp_model(tuned, straight.checkpoints[-1])
    for name, mod in tuned.named_modules():
        if isinstance(mod, LoRALinear):
            assert torch.equal(mod.base.weight, pretrained.get_submodule(name).weight)
            assert mod.lora_b.weight.abs().sum() > 0
    assert torch.equal(tuned.tok_embeddings.weight, pretrained.tok_embeddings.weight)

    # 5. export-merged: a plain model computing what the adapted one computes
    out = tmp_path / "merged.pt"
    job = tmp_path / "ft.yaml"
    job.write_text(json.dumps(spec.to_dict()))  # JSON is YAML
    assert main(["export-merged", str(job), "--out", str(out)]) == 0
    merged = GPT(model_config(spec.worker_dict()["model"]))
    merged.load_state_dict(torch.load(out, weights_only=True))
    x = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert torch.allclose(merged(x), tuned(x), atol=1e-4)
