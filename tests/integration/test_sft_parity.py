"""Supervised fine-tuning data (a loss mask: completion tokens alone are targets) on parallel layouts reproduces the
single-process reference (fp32, CPU, 1e-4 relative): losses, global gradient norms and held-out losses.

The reference takes the mean cross entropy over the counted targets of the whole global batch; the layouts split the
batch over dp ranks, microbatches, cp shares and pipeline microbatches, each holding a different count (examples'
completions run from none to ~60 bytes, prompts from 1 to ~40), so a mean per microbatch averaged would differ.
An MoE model's auxiliary losses (through ``AuxLossGrad``, per microbatch) keep the scale they have without a mask:
means over the sequences, whatever count of completion tokens a microbatch holds (dp=2, and dp=2 x ep=2).
Ranks are spawned processes over gloo (tests/support/parity_harness.py, no Ray), the layouts of one world size in one
spawn, 3 steps each.
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped
from tests.support.reference import assert_matches, references_by_family
from tests.support.sft import prepare_sft
from workers.data import TokenDataset
from workers.data.loader import IGNORE_INDEX

STEPS = 3
EVAL = {"every": 2, "batches": 1}
FAMILIES = {"gpt": {"init_std": 0.1}, "llama-document": {"arch": "llama", "attention_mask": "document",
                                                          "init_std": 0.1},
            # aux losses weighted up, so a scale that followed the count of completion tokens moves the norms
            "gpt-moe": {"init_std": 0.1, "n_layers": 2,
                        "moe": {"experts": 4, "group": "sequence", "router": "switch", "capacity_factor": 1.0,
                                "aux_loss_weight": 1.0, "z_loss_weight": 0.1}}}
LAYOUTS = {  # name: (family, parallel, with evaluation)
    "dp2-tp2-microbatches2": ("gpt", {"dp": 2, "tp": 2}, True),
    "pp2-dp2-zero1": ("gpt", {"pp": 2, "dp": 2, "zero": 1}, True),
    "cp2-dp2-zero2": ("gpt", {"cp": 2, "dp": 2, "zero": 2}, True),
    "dp4-zero3": ("gpt", {"dp": 4, "zero": 3}, False),
    "document-pp2-tp2": ("llama-document", {"pp": 2, "tp": 2}, True),
    "moe-dp2": ("gpt-moe", {"dp": 2}, True),
    "moe-dp2-ep2": ("gpt-moe", {"dp": 2, "ep": 2}, False),
}


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    """(training data, held-out data) of ~400 prompt/completion pairs of very different lengths."""
    return prepare_sft(tmp_path_factory.mktemp("sft"))


def _spec(sft_data, tmp_path, family: str, parallel: dict | None = None, evaluates: bool = True):
    train, heldout = sft_data
    held_out = {"eval": {**EVAL, "path": str(heldout)}} if evaluates else {}
    return tiny_spec(train, tmp_path, parallel={**(parallel or {}), "device": "cpu"}, model=FAMILIES[family],
                     train={"steps": STEPS}, **held_out)


@pytest.fixture(scope="module")
def references(sft_data, tmp_path_factory):
    """Per family: (losses, grad norms, held-out losses by step) of one process, computed once."""
    return references_by_family(lambda family: _spec(sft_data, tmp_path_factory.mktemp(family), family), STEPS)


def test_microbatches_hold_different_counts_of_counted_targets(sft_data):
    """Not a vacuous comparison: the first step's eight microbatch-sized slices count unequally."""
    _, targets = TokenDataset(sft_data[0], 32, 0).batch(0, 8)
    counts = (targets != IGNORE_INDEX).sum(1).tolist()
    assert len(set(counts)) > 3 and 0 < sum(counts) < targets.numel()


@pytest.fixture(scope="module")
def runs(sft_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft-parity")
    return run_grouped({name: _spec(sft_data, tmp / name, family, parallel, evaluates)
                        for name, (family, parallel, evaluates) in LAYOUTS.items()})


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_masked_layout_matches_single_process_reference(name, references, runs):
    family, _, evaluates = LAYOUTS[name]
    assert_matches(ran(runs, name), references(family), evaluates)
