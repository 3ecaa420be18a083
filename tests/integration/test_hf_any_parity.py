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
from tests.support.hf import (
    assert_first_step_then_reference,
    dcp_model_tensors,
    init_from_layouts,
    save_hf_gpt2,
)
from tests.support.parity_harness import ran, run_layout
from tests.support.reference import reference_run

STEPS = 3
LAYOUTS = {"dp2-zero3": {"dp": 2, "zero": 3}, "dp2-zero2": {"dp": 2, "zero": 2}, "dp2-zero1": {"dp": 2, "zero": 1},
           "dp2-zero0": {"dp": 2, "zero": 0}}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_hf_gpt2(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def layouts(hf_dir, token_data, tmp_path_factory):
    """Each layout's spec, its final checkpoint, and the runs (one spawn per world size, ``run_grouped``); the
    shape fields are left to config.json."""
    shape = {"d_model": None, "n_layers": None, "n_heads": None, "d_ff": None}
    return init_from_layouts(hf_dir, token_data, tmp_path_factory, LAYOUTS, STEPS, model=shape)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_transformers_then_the_single_process(name, hf_dir, layouts):
    specs, _, runs = layouts
    spec, run = specs[name], ran(runs, name)
    assert spec.model.arch == "hf" and spec.model.hf_config["model_type"] == "gpt2"
    assert_first_step_then_reference(run, spec, hf_dir, STEPS)
    assert run.losses[-1] < run.losses[0]


def test_zero3_checkpoint_exports_exactly_through_save_pretrained(layouts, tmp_path):
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    specs, written, _ = layouts
    out = export_hf_weights(specs["dp2-zero3"], str(written["dp2-zero3"]), str(tmp_path / "exported"))
    held = {k.removeprefix("lm."): v for k, v in dcp_model_tensors(written["dp2-zero3"], tmp_path / "c.pt").items()}
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


