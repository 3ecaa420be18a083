"""What ``parallel.param_gather_dtype`` puts on the wire, torch-free: the ranks' quantizer
(``workers/parallel/quantized_gather.py``) and the planner's communication model read the same figures."""

from __future__ import annotations

BLOCK = 256  # values per fp32 scale of the int8 gather: ZeRO++'s qwZ granularity; the scales add 4/256 bytes a value
_WIDTH = {"fp32": 4, "bf16": 2}


def wire_bytes_per_value(dtype: str) -> float:
    """Bytes one parameter value costs in ZeRO-1's all-gather under ``parallel.param_gather_dtype``: int8 codes
    plus a share of their block's fp32 scale (3.94x fewer than fp32), or the float's width."""
    return 1 + 4 / BLOCK if dtype == "int8" else _WIDTH[dtype]
