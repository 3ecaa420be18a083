"""Published large runs the planner is checked against (README table, ``benchmarks/planner.py``, unit tests).

- Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", Table 1): the 1T-parameter GPT, 128 layers, hidden 25,600, 160 heads, sequence 2,048,
  batch 3,072 sequences, on 3,072 A100 80 GB: tp=8, pp=64, dp=6, activation recomputation.
- Llama 3 405B (Dubey et al. 2024, Table 4): 126 layers, hidden 16,384, FFN 53,248, 128 heads over 8 K/V
  heads, vocabulary 128,256, sequence 8,192, 16M tokens a step (2,048 sequences), on 16,384 H100 80 GB:
  tp=8, cp=1, pp=16, dp=128 (126 layers over 16 stages: uneven).
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.planning.layout_search import Shape


@dataclass(frozen=True)
class PublishedRun:
    name: str
    shape: Shape
    gpu: str
    gpus: int
    degrees: dict  # dp, tp, pp, cp as published


RUNS = {
    "megatron-1t": PublishedRun(
        "Megatron 1T (Narayanan et al. 2021)",
        Shape(128, 25600, 160, 4 * 25600, 51200, 2048, 3072, arch="gpt", learned_positions=True, fsdp_policy=True),
        "A100", 3072, {"dp": 6, "tp": 8, "pp": 64, "cp": 1}),
    "llama3-405b": PublishedRun(
        "Llama 3 405B (Dubey et al. 2024)",
        Shape(126, 16384, 128, 53248, 128256, 8192, 2048, kv_heads=8, arch="llama", fsdp_policy=True),
        "H100", 16384, {"dp": 128, "tp": 8, "pp": 16, "cp": 1}),
}
