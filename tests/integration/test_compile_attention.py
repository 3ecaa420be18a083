"""``train.compile`` with context parallelism and document masks: attention is a ``torch.library`` custom operator
(``workers.model.attention_ops``), so each block compiles whole (``fullgraph``) around it, its sends, receives and
all-to-alls inside the operator.

Two checks. Compiled against eager on the same weights and inputs (forward output and every gradient, 1e-4): one
rank with documents and a sliding window, and cp2 ring, all-gather and Ulysses with documents, each rank's
Dynamo counters showing that one graph was compiled for the blocks with no graph break and no recompile across
microbatches whose documents differ. And the trainer's compiled runs against the single-process reference (losses
and gradient norms, 3 steps, 1e-4): cp2 ring and one rank, both document-masked. Ranks are spawned processes over
gloo (tests/support/parity_harness.py, no Ray). Integration, not unit: inductor takes tens of seconds a graph on a
2-core machine.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.documents import write_documents
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import rank_ports, run_layouts, spawn_ranks
from tests.support.reference import reference_run
from workers.data import prepare_data

STEPS = 3
LLAMA = {"arch": "llama", "n_kv_heads": 2, "attention_mask": "document", "init_std": 0.1}
SEQ = 64
MICROBATCHES = 2  # each with its own documents: the compiled blocks must neither recompile nor mask alike


def _pair(cfg, shard=None, backend="inductor"):
    """(eager model, compiled copy) of the same weights; under cp both hold the rank's ``shard``."""
    import copy

    from workers.model.registry import build_model, family
    from workers.parallel.compile import compile_blocks

    torch.manual_seed(0)
    eager = build_model(cfg)
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        for module in model.modules():
            if shard is not None and hasattr(module, "context_shard"):
                module.context_shard = shard
    compile_blocks(compiled, family(cfg.arch), backend)
    return eager, compiled


def _microbatch(i: int):
    """Tokens [2, SEQ] and their document ids, different for every microbatch (seeded)."""
    gen = torch.Generator().manual_seed(i)
    tokens = torch.randint(0, 64, (2, SEQ), generator=gen)
    return tokens, (torch.rand(2, SEQ, generator=gen) < 0.1).long().cumsum(-1)


def _largest_differences(cfg, shard=None, split=lambda t: t, backend="inductor") -> dict:
    """Per microbatch, the largest difference between the eager and compiled outputs and gradients (this rank's
    share of the sequence), and Dynamo's counters after all of them."""
    from torch._dynamo.utils import counters

    from workers.model.documents import Documents, attending

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = _pair(cfg, shard, backend)
    out = {"output": [], "grads": []}
    for i in range(MICROBATCHES):
        tokens, ids = _microbatch(i)
        results = []
        for model in (eager, compiled):
            with attending([model], Documents(ids.clone())):
                logits = model(split(tokens))
                logits.float().pow(2).mean().backward()
            results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
            model.zero_grad()
        (a, grads_a), (b, grads_b) = results
        out["output"].append(((a - b).abs().max() / a.abs().max()).item())
        out["grads"].append(max(((x - y).abs().max() / x.abs().max().clamp_min(1e-12)).item()
                                for x, y in zip(grads_a, grads_b, strict=True)))
    out["graphs"] = counters["stats"]["unique_graphs"]
    out["breaks"] = dict(counters["graph_break"])
    out["recompiles"] = dict(counters["recompiles"])
    return out


def _config(**extra):
    from workers.model.config import ModelConfig

    return ModelConfig(arch="llama", n_kv_heads=2, d_model=32, n_layers=2, n_heads=4, seq_len=SEQ, vocab_size=64,
                       init_std=0.1, **extra)


def _assert_compiled_as_eager(found: dict, where: str) -> None:
    assert max(found["output"]) < 1e-4 and max(found["grads"]) < 1e-4, (where, found)
    # the blocks share one graph; a causal warm-up is not run, so documents never recompile it
    assert found["graphs"] == 1 and not found["breaks"] and not found["recompiles"], (where, found)


def test_one_rank_compiled_with_documents_and_a_window_matches_eager(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    _assert_compiled_as_eager(_largest_differences(_config(sliding_window=24)), "one rank")


def _cp_rank(rank: int, ports, results) -> None:
    """One cp rank: every ``cp_impl`` compiled against eager on this rank's zigzag share. Dynamo's trace and
    AOTAutograd's (the operators' fake implementations, the backward tied to them) are what cp adds, so inductor's
    code generation, which the one-rank and trainer tests run, is skipped (``aot_eager``: minutes less on a CPU)."""
    from tests.support.parity_harness import gloo_dp_mesh
    from workers.parallel.context_layout import apply_context_parallel, split_sequence

    mesh = gloo_dp_mesh(rank, ports, 2)
    found = {}
    for impl in ("ring", "allgather", "ulysses"):
        shard = apply_context_parallel(torch.nn.Module(), mesh, impl)
        found[impl] = _largest_differences(_config(), shard, lambda t: split_sequence(t, 2, rank), "aot_eager")
    results.put((rank, found))


def test_cp2_compiled_with_documents_matches_eager(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    by_rank = spawn_ranks(_cp_rank, (rank_ports(1),), 2, timeout_s=900)
    for rank, found in by_rank.items():
        for impl, figures in found.items():
            _assert_compiled_as_eager(figures, f"cp2 {impl} rank {rank}")


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """Training data of ~300 short documents, a few per 32-token window."""
    root = tmp_path_factory.mktemp("documents")
    write_documents(root / "src", 300, 0)
    prepare_data([root / "src"], root / "train")
    return root / "train"


def test_compiled_document_masked_runs_match_the_reference(documents, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    layouts = {"cp2-ring": {"cp": 2, "cp_impl": "ring"}, "dp2": {"dp": 2}}
    specs = [tiny_spec(documents, tmp_path / name, model=LLAMA, train={"steps": STEPS, "compile": True},
                       parallel={**parallel, "device": "cpu"}) for name, parallel in layouts.items()]
    runs = run_layouts([s.worker_dict() for s in specs], 2, STEPS, timeout_s=900)
    reference = reference_run(tiny_spec(documents, tmp_path / "reference", model=LLAMA, train={"steps": STEPS}),
                              STEPS)
    for name, run in zip(layouts, runs, strict=True):
        assert run.losses == pytest.approx(reference[0], rel=1e-4), name
        assert run.grad_norms == pytest.approx(reference[1], rel=1e-4), name
