"""Hugging Face Llama checkpoints in (``model.init_from``, each rank reading its own slices) and out
(``export-hf``), on parallel layouts, without Ray (tests/support/parity_harness.py).

The checkpoint is made here with ``transformers`` (random weights, sharded save_pretrained). Each layout's
first step (before any update: loss and global gradient norm) must equal ``transformers``'
LlamaForCausalLM on the same batch (1e-5), its later steps the single-process reference (1e-4), and the
DCP checkpoint it writes at the end must export (``export-hf``) to exactly the tensors DCP holds, in a
directory ``transformers`` loads. ``raymesh generate`` on such a checkpoint decodes greedily what
``transformers``' ``generate`` decodes from the exported directory.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from orchestrator.spec.lora import export_hf_weights
from tests.support.hf import assert_first_step_and_reference, save_hf_llama
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped
from workers.model.hf_io import hf_name

STEPS = 3
LAYOUTS = {
    "tp2-pp2": {"tp": 2, "pp": 2},
    "dp2-zero3": {"dp": 2, "zero": 3},
    "tp2-dp2": {"tp": 2, "dp": 2},
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The tiny job's shape (d_model 32, 4 layers, 4 heads over 2 K/V heads, d_ff 64) as a sharded HF directory."""
    return save_hf_llama(tmp_path_factory.mktemp("hf"), intermediate_size=64, max_shard_size="40KB")


@pytest.fixture(scope="module")
def layouts(hf_dir, token_data, tmp_path_factory):
    """Each layout's spec, its final checkpoint and its run, those of one size in one spawn (``run_grouped``)."""
    specs, written = {}, {}
    for name, parallel in LAYOUTS.items():
        tmp = tmp_path_factory.mktemp(name)
        specs[name] = tiny_spec(token_data, tmp, parallel={**parallel, "device": "cpu"},
                                model={"init_from": str(hf_dir)}, train={"steps": STEPS},
                                checkpoint={"dir": str(tmp / "ckpt")})
        written[name] = tmp / "ckpt" / f"step-{STEPS:08d}"
    runs = run_grouped(specs, checkpoints={name: str(path) for name, path in written.items()})
    return {name: (specs[name], written[name], runs) for name in LAYOUTS}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_init_from_layout_matches_transformers_and_exports_exactly(name, hf_dir, layouts, tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    spec, written, runs = layouts[name]
    assert spec.model.arch == "llama" and spec.model.kv_heads == 2
    run = ran(runs, name)

    assert_first_step_and_reference(run, spec, hf_dir, STEPS)

    out = export_hf_weights(spec, str(written), str(tmp_path / "exported"))
    held = _dcp_model_tensors(written, tmp_path / "ckpt.pt")
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == {hf_name(k) for k in held}
    for key, value in held.items():
        assert torch.equal(exported[hf_name(key)], value), key
    reloaded = LlamaForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in exported.items())


def _dcp_model_tensors(checkpoint, scratch) -> dict[str, torch.Tensor]:
    """The ``model`` entries of a DCP checkpoint, read by DCP's own converter (not raymesh's loader)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(scratch))
    return torch.load(scratch, weights_only=False)["model"]


def test_generate_from_a_layout_checkpoint_decodes_as_transformers_does(layouts, tmp_path):
    """`raymesh generate --temperature 0` on the tp2-pp2 run's checkpoint (read whole, through DCP) picks the
    tokens ``transformers`` picks from the same checkpoint exported, and prints them as the data's text."""
    from transformers import LlamaForCausalLM

    spec, written, _ = layouts["tp2-pp2"]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec.to_dict()))
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "generate", str(job), "--prompt", "def ",
                           "--temperature", "0", "--max-new-tokens", "20", "--no-stop", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["checkpoint"] == str(written) and got["prompt_tokens"] == 5  # end-of-document id, then "def "
    hf = LlamaForCausalLM.from_pretrained(export_hf_weights(spec, str(written), str(tmp_path / "hf")))
    prompt = torch.tensor([[0, *b"def "]])
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    ids = expected[0, 5:].tolist()
    assert got["samples"] == [{"text": bytes(ids).decode("utf-8", errors="replace"), "ids": ids, "ended": False}]
