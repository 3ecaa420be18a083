"""A Hugging Face causal LM raymesh has no family for (a tiny random GPT-2: learned positions, LayerNorm, Conv1D
projections, tied head) trains as ``model.arch: hf`` under data parallelism and ZeRO, without Ray
(tests/support/parity_harness.py; fp32, CPU).

Seed 002 line 174: data parallelism and FSDP wrap any network without dissecting it. Each layout's first step
must equal ``transformers``' own model on the same batch (1e-5), its later steps the single-process reference
(1e-4); the dp2 ZeRO-3 run's final checkpoint must resume into a ZeRO-1 layout exactly where an unbroken run
goes, and export (``export-hf``, transformers' save_pretrained) to exactly the tensors DCP holds, in a directory
``from_pretrained`` loads to the same tensors.
"""

from __future__ import annotations

import pytest
import torch

from orchestrator.spec.lora import export_hf_weights
from tests.support.hf import save_hf_gpt2, transformers_first_step
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped, run_layout
from tests.support.reference import reference_run

STEPS = 3
LAYOUTS = {"dp2-zero3": {"dp": 2, "zero": 3}, "dp2-zero2": {"dp": 2, "zero": 2}, "dp2-zero1": {"dp": 2, "zero": 1},
           "dp2-zero0": {"dp": 2, "zero": 0}}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_hf_gpt2(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def layouts(hf_dir, token_data, tmp_path_factory):
    """Each layout's spec, its final checkpoint, and the runs (one spawn per world size, ``run_grouped``)."""
    specs, written = {}, {}
    for name, parallel in LAYOUTS.items():
        tmp = tmp_path_factory.mktemp(name)
        specs[name] = tiny_spec(token_data, tmp, parallel={**parallel, "device": "cpu"},
                                model={"d_model": None, "n_layers": None, "n_heads": None, "d_ff": None,
                                       "init_from": str(hf_dir)},
                                train={"steps": STEPS}, checkpoint={"dir": str(tmp / "ckpt")})
        written[name] = tmp / "ckpt" / f"step-{STEPS:08d}"
    runs = run_grouped(specs, checkpoints={name: str(path) for name, path in written.items()})
    return specs, written, runs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_transformers_then_the_single_process(name, hf_dir, layouts):
    specs, _, runs = layouts
    spec, run = specs[name], ran(runs, name)
    assert spec.model.arch == "hf" and spec.model.hf_config["model_type"] == "gpt2"
    loss, norm = transformers_first_step(spec, hf_dir)
    assert run.losses[0] == pytest.approx(loss, rel=1e-5)
    assert run.grad_norms[0] == pytest.approx(norm, rel=1e-5)
    losses, grad_norms = reference_run(spec, STEPS)
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4)
    assert run.losses[-1] < run.losses[0]


def test_zero3_checkpoint_exports_exactly_through_save_pretrained(layouts, tmp_path):
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    specs, written, _ = layouts
    out = export_hf_weights(specs["dp2-zero3"], str(written["dp2-zero3"]), str(tmp_path / "exported"))
    held = {k.removeprefix("lm."): v for k, v in _dcp_model_tensors(written["dp2-zero3"], tmp_path / "c.pt").items()}
    exported = load_file(str(out / "model.safetensors"))
    assert exported and set(exported) <= set(held)
    for key, value in exported.items():
        assert torch.equal(value, held[key]), key
    reloaded = GPT2LMHeadModel.from_pretrained(out).state_dict()
    for key, value in held.items():
        assert torch.equal(reloaded[key], value), key  # the tied head too: it is the embedding DCP holds


def test_zero3_checkpoint_resumes_on_zero1_as_the_unbroken_run_goes_on(layouts, tmp_path):
    """DCP reshards the ZeRO-3 state onto a ZeRO-1 layout; its next steps are the single process's 4th and 5th."""
    specs, written, _ = layouts
    spec = specs["dp2-zero1"].model_copy(deep=True)
    resumed = run_layout(spec.worker_dict(), 2, 2, resume=str(written["dp2-zero3"]))
    losses, _ = reference_run(spec, STEPS + 2)
    assert resumed.losses == pytest.approx(losses[STEPS:], rel=1e-4)


def _dcp_model_tensors(checkpoint, scratch) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(scratch))
    return torch.load(scratch, weights_only=False)["model"]
