"""train.compile, optim.implementation and parallel.fsdp_prefetch reproduce the single-process reference (fp32,
CPU, 1e-4 relative).

Each layout's blocks are compiled by inductor (what users run; about 15 s per layout on a cold cache on this
2-core CPU, the blocks of one rank sharing one graph) and the reference steps PyTorch's per-parameter AdamW,
so a layout with a fused or foreach optimizer also checks those kernels over DTensor parameters (FSDP2's
shards, TP's). An MoE layout compiles each block's parts around its eager MoE layer. Three steps: compile
parity is per step, not per step count. Ranks are spawned over gloo
(tests/support/parity_harness.py); the layouts share one spawn.
Integration, not unit: spawning ranks and compiling take seconds.
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts
from tests.support.reference import reference_run

STEPS = 3
LLAMA = {"arch": "llama", "n_kv_heads": 2}
LAYOUTS = {  # name -> sections over the tiny Llama job, each on 2 ranks
    # FSDP2 units compiled before fully_shard and gathering 2 blocks ahead, recompute from inside the compiled
    # forward, fused AdamW on the shards
    "dp2-zero3-prefetch2-full-recompute-fused": {"parallel": {"dp": 2, "zero": 3, "fsdp_prefetch": 2},
                                                 "memory": {"recompute": "full"}, "optim": {"implementation": "fused"}},
    # TP's DTensor plans traced inside each block, sequence parallel, foreach AdamW on DTensors
    "tp2-foreach": {"parallel": {"tp": 2}, "optim": {"implementation": "foreach"}},
    # MoE over dp2 x ep2: each block's attention and norms compiled, its MoE layer (routing, the all-to-all
    # dispatch) eager; full recompute replays both inside the block's checkpoint
    "dp2-ep2-moe-full-recompute": {"parallel": {"dp": 2, "ep": 2}, "memory": {"recompute": "full"},
                                   "model": {"n_layers": 2, "moe": {"experts": 4, "group": "sequence",
                                                                    "router": "topk"}}},
}


def test_compiled_layouts_match_single_process_reference(token_data, tmp_path, monkeypatch):
    # inductor's own compile workers: one per rank (the ranks are the parallelism on a 2-core machine; its
    # default of one per core starts a worker pool in every rank); the backend is unchanged
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    specs = [tiny_spec(token_data, tmp_path / name, model={**LLAMA, **sections.get("model", {})},
                       train={"steps": STEPS, "compile": True},
                       **{k: {**v, "device": "cpu"} if k == "parallel" else v for k, v in sections.items()
                          if k != "model"})
             for name, sections in LAYOUTS.items()]
    runs = run_layouts([s.worker_dict() for s in specs], 2, STEPS)
    for name, spec, run in zip(LAYOUTS, specs, runs, strict=True):
        losses, grad_norms = reference_run(spec, STEPS)
        assert run.losses == pytest.approx(losses, rel=1e-4), name
        assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4), name
