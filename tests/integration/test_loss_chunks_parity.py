"""`train.loss_chunks`: layouts whose head and loss run per chunk of tokens reproduce the single-process reference,
which takes the whole logits (fp32, CPU, 1e-4 relative): losses, global gradient norms and held-out losses.

Wherever the head runs: sharded with ZeRO-3, column-parallel over tp (the logits gathered over the vocabulary, a
chunk at a time; with sequence parallelism the hidden state gathered first), on a pipeline's last stage (1F1B,
and a zero-bubble schedule, which defers the weight gradients), tied to the embedding, with a LoRA adapter on
it (QLoRA: an NF4 base), in an MoE model with its auxiliary losses, and under a loss mask (the summed loss over
the global count). 3 chunks of 32 tokens: uneven sizes. Ranks are spawned processes over gloo
(tests/support/parity_harness.py, no Ray), one spawn per world size.
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped
from tests.support.reference import assert_matches, reference_eval, reference_run
from tests.support.sft import prepare_sft

STEPS = 3
CHUNKS = {"loss_chunks": 3, "steps": STEPS}
MOE = {"experts": 4, "group": "sequence", "router": "topk", "aux_loss_weight": 0.01}  # aux losses as before
LLAMA_TIED = {"arch": "llama", "n_kv_heads": 2, "tie_embeddings": True}
CASES = {  # name: (data, model, parallel, sections beside)
    "dp2-zero3": ("tokens", {}, {"dp": 2, "zero": 3}, {}),
    "tp2-sp": ("tokens", {}, {"tp": 2}, {}),
    "tp2-no-sp": ("tokens", {}, {"tp": 2, "sequence_parallel": False}, {}),
    "pp2-1f1b": ("tokens", {}, {"pp": 2, "pp_schedule": "1f1b"}, {}),
    "pp2-zbv": ("tokens", {}, {"pp": 2, "pp_schedule": "zbv"}, {}),
    "llama-tied-tp2-dp2-zero3": ("tokens", LLAMA_TIED, {"tp": 2, "dp": 2, "zero": 3}, {}),
    "lora-head-tp2-sp": ("tokens", {"lora": {"rank": 4, "alpha": 8.0, "targets": ["wq", "output"]}}, {"tp": 2}, {}),
    "qlora-head-dp2": ("tokens", {"lora": {"rank": 4, "alpha": 8.0, "quantize": "nf4", "targets": ["wq", "output"]}},
                       {"dp": 2}, {}),
    "moe-dp2-ep2": ("tokens", {"n_layers": 2, "moe": MOE}, {"dp": 2, "ep": 2}, {}),
    "masked-dp2-tp2-eval": ("sft", {"init_std": 0.1}, {"dp": 2, "tp": 2}, {"eval": {"every": 2, "batches": 1}}),
}


@pytest.fixture(scope="module")
def specs(token_data, tmp_path_factory):
    """Each case's job, with ``train.loss_chunks: 3``."""
    root = tmp_path_factory.mktemp("loss-chunks")
    train, heldout = prepare_sft(root)
    data = {"tokens": token_data, "sft": train}
    out = {}
    for name, (which, model, parallel, sections) in CASES.items():
        if "eval" in sections:
            sections = {"eval": {**sections["eval"], "path": str(heldout)}}
        out[name] = tiny_spec(data[which], root / name, model=model, parallel={**parallel, "device": "cpu"},
                              train=CHUNKS, **sections)
    return out


@pytest.fixture(scope="module")
def runs(specs):
    return run_grouped(specs)


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_head_matches_single_process_reference(name, specs, runs):
    spec = specs[name]
    evaluates = spec.eval.every > 0
    held_out = reference_eval(spec, STEPS) if evaluates else {}
    assert_matches(ran(runs, name), (*reference_run(spec, STEPS), held_out), evaluates)
