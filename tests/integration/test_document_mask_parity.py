"""Document masking (``model.attention_mask: document``) on parallel layouts reproduces the document-masked
single-process reference (fp32, CPU, 1e-4 relative): losses, global gradient norms and held-out losses.

Each layout hands the attention cores every microbatch's document ids its own way: the plain loop under dp/ZeRO 0-3
and tp with and without sequence parallelism, the pipeline's chunks (stages that receive activations, not tokens,
and a backward that replays the forward under recompute, full or selective), the evaluation's microbatches (a
pipeline sweep among them), and context parallelism, where a cp rank masks its zigzag share of the queries over the
whole window's keys (all-gather, Ulysses) or over each K/V block passed round the ring. The data are many short
documents, a few per 32-token window, so most windows cross a boundary. Learned positions restart at each document
(cp2, dp2, tp2 with sequence parallelism). Ranks are spawned processes over gloo (tests/support/parity_harness.py,
no Ray), the layouts of one world size in one spawn, 3 steps each; the reference is computed once per family.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.support.documents import write_documents
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped
from tests.support.reference import assert_matches, reference_run, references_by_family
from workers.data import prepare_data

STEPS = 3
# init_std 0.1: attention scores far from uniform, so what the mask hides moves the losses (the held-out one too)
# well past the tolerance; at the default 0.02 a held-out loss scored causally was within 1e-4 of the masked one
FAMILIES = {
    "gpt": {"attention_mask": "document", "init_std": 0.1},
    "llama-gqa": {"attention_mask": "document", "init_std": 0.1, "arch": "llama", "n_kv_heads": 2},
    # learned positions restart at each document (Megatron's --reset-position-ids), also on a cp rank's share
    "gpt-learned": {"attention_mask": "document", "init_std": 0.1, "positions": "learned"},
    # MoE keys capacity (per sequence) and expert dropout by stream position: the mask must leave both alone
    "gpt-moe": {"attention_mask": "document", "init_std": 0.1, "n_layers": 2,
                "moe": {"experts": 4, "group": "sequence", "router": "switch", "capacity_factor": 1.0,
                        "aux_loss_weight": 0.01, "expert_dropout": 0.1}},
    # QLoRA over a Hugging Face Llama (``model.init_from``: the ``hf_llama`` fixture's directory, set in ``_spec``)
    "hf-qlora": {"attention_mask": "document", "d_model": 64, "n_layers": 2, "d_ff": 128,
                 "lora": {"rank": 4, "alpha": 8.0, "quantize": "nf4"}},
}
EVAL = {"every": 2, "batches": 1}
SAVES = "pp2-dp2-zbv"  # the layout whose last step is saved, for generate and export-hf to read
LAYOUTS = {  # name: (family, parallel, memory, with evaluation)
    "dp2-tp2-nosp-zero0": ("gpt", {"dp": 2, "tp": 2, "sequence_parallel": False}, {}, True),
    "dp2-tp2-sp-zero3": ("llama-gqa", {"dp": 2, "tp": 2, "zero": 3}, {}, False),
    "dp4-zero2-selective": ("gpt", {"dp": 4, "zero": 2}, {"recompute": "selective"}, False),
    "pp2-dp2-zero1-full-recompute": ("gpt", {"pp": 2, "dp": 2, "zero": 1}, {"recompute": "full"}, True),
    "pp2-cp2-allgather-selective": ("llama-gqa", {"pp": 2, "cp": 2, "cp_impl": "allgather"},
                                    {"recompute": "selective"}, True),
    "cp2-tp2-ulysses": ("llama-gqa", {"cp": 2, "tp": 2, "cp_impl": "ulysses"}, {}, False),
    "cp4-ring": ("gpt", {"cp": 4, "cp_impl": "ring"}, {}, True),
    "dp4-measured": ("gpt", {"dp": 4}, {"measure": True}, False),
    "dp4-ep2-moe": ("gpt-moe", {"dp": 4, "ep": 2}, {}, False),
    # two stages a rank, split backward: the W chunks (and every chunk of the second stage) take their documents
    "pp2-dp2-zbv": ("llama-gqa", {"pp": 2, "dp": 2, "pp_schedule": "zbv"}, {}, False),
    "dp2-pp2-hf-qlora": ("hf-qlora", {"dp": 2, "pp": 2}, {}, False),
    "cp2-learned": ("gpt-learned", {"cp": 2}, {}, True),
    "dp2-learned": ("gpt-learned", {"dp": 2}, {}, False),
    # the position table's output sharded over the tokens of a [batch, seq] lookup under sequence parallelism
    "tp2-sp-learned": ("gpt-learned", {"tp": 2}, {}, False),
}


@pytest.fixture(scope="module")
def documents(tmp_path_factory, hf_llama):
    """(training data, held-out data, a Hugging Face Llama): ~300 and ~60 short documents, prepared as bytes."""
    root = tmp_path_factory.mktemp("documents")
    for name, count, seed in (("train", 300, 0), ("heldout", 60, 1)):
        write_documents(root / f"{name}-src", count, seed)
        prepare_data([root / f"{name}-src"], root / name)
    return root / "train", root / "heldout", hf_llama


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny Hugging Face Llama directory (GQA, Llama-3 rotary), 64 wide so NF4's blocks divide its weights."""
    from tests.support.hf import save_hf_llama

    return save_hf_llama(tmp_path_factory.mktemp("hf-llama"), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2)


def _spec(documents, tmp_path, family: str, parallel: dict | None = None, memory: dict | None = None,
          evaluates: bool = True):
    train, heldout, hf_dir = documents
    held_out = {"eval": {**EVAL, "path": str(heldout)}} if evaluates else {}
    model = {**FAMILIES[family], **({"init_from": str(hf_dir)} if "lora" in FAMILIES[family] else {})}
    return tiny_spec(train, tmp_path, parallel={**(parallel or {}), "device": "cpu"}, model=model,
                     memory=memory or {}, train={"steps": STEPS}, **held_out)


@pytest.fixture(scope="module")
def references(documents, tmp_path_factory):
    """Per family: (losses, grad norms, held-out losses by step) of one process, computed once."""
    return references_by_family(lambda family: _spec(documents, tmp_path_factory.mktemp(family), family), STEPS)


@pytest.fixture(scope="module")
def specs(documents, tmp_path_factory):
    """Every layout's job; ``SAVES``' checkpoints into its own directory."""
    tmp = tmp_path_factory.mktemp("document-parity")
    out = {name: _spec(documents, tmp / name, *layout) for name, layout in LAYOUTS.items()}
    out[SAVES] = out[SAVES].with_overrides([f"checkpoint.dir={tmp / SAVES / 'ckpt'}"])
    return out


@pytest.fixture(scope="module")
def runs(specs):
    """Every layout's ranks in one spawn of four (``run_grouped``), ``SAVES``' last step saved."""
    saved = specs[SAVES].checkpoint_dir() / f"step-{STEPS:08d}"
    return run_grouped(specs, checkpoints={SAVES: str(saved)})


def test_the_reference_masks_documents(documents, references, tmp_path):
    """Not a vacuous comparison: the data cross document boundaries, so causal attention trains otherwise."""
    causal = tiny_spec(documents[0], tmp_path, model={"attention_mask": "causal"}, train={"steps": STEPS})
    assert reference_run(causal, STEPS)[0] != pytest.approx(references("gpt")[0], rel=1e-4)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_document_masked_layout_matches_single_process_reference(name, references, runs):
    family, _, _, evaluates = LAYOUTS[name]
    assert_matches(ran(runs, name), references(family), evaluates)


def test_the_document_mask_saves_nothing_beyond_causal_attention(runs, documents, tmp_path):
    """The activation bytes a rank saves (the trainer's meter) are the planner's, and the planner's are causal
    attention's: attention within documents runs blockwise and saves no ``[micro_batch, 1, seq, seq]`` mask (the
    dense build saved one a microbatch in flight)."""
    from orchestrator.planning.estimate import peak_rank

    family, parallel, memory, _ = LAYOUTS["dp4-measured"]
    spec = _spec(documents, tmp_path, family, parallel, memory, evaluates=False)
    causal = spec.with_overrides(["model.attention_mask=causal"])
    assert peak_rank(spec).activation_bytes == peak_rank(causal).activation_bytes
    for measured in ran(runs, "dp4-measured").activation_bytes.values():
        assert measured == pytest.approx(peak_rank(spec).activation_bytes, rel=1e-3)


def test_generate_and_export_hf_read_a_document_masked_checkpoint(runs, specs, tmp_path, capsys):
    """The mask is how training attends, not a weight or a field the checkpoint's job record holds: `raymesh
    generate` (causal over its one prompt) and `export-hf` read a document-masked run's checkpoint as any other."""
    from orchestrator.cli.commands import main

    ran(runs, SAVES)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(specs[SAVES].to_dict()))
    args = ["--prompt", "ab", "--temperature", "0", "--max-new-tokens", "4", "--no-stop", "--json"]
    assert main(["generate", str(job), *args]) == 0
    assert len(json.loads(capsys.readouterr().out)["samples"][0]["ids"]) == 4
    assert main(["export-hf", str(job), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
