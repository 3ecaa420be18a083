"""Model FLOPs per token and per-rank peak FLOP/s, for the MFU estimate.

Training costs ≈ 6·N FLOPs per token for N parameters plus 12·L·d·s for
attention scores (PaLM's MFU accounting); in an MoE model N counts the routed
experts a token passes through, not all of them (nor none). Peaks are dense bf16 tensor-core
figures from the vendors' data sheets; a CPU gets a nominal 0.1 TFLOP/s per
rank (one core's FMA throughput, order of magnitude) unless the job file says
otherwise, so MFU there is only comparable run to run.
"""

from __future__ import annotations

from orchestrator.planning.estimate import moe_params, mtp_layers, stage_params
from orchestrator.planning.time_model import GPUS, flops_per_token
from orchestrator.spec import JobSpec

# the planner's GPU types (time_model.GPUS) plus two it does not price layouts for
PEAK_TFLOPS = {**{name: g.peak_flops / 1e12 for name, g in GPUS.items()}, "L40S": 362.0, "A10": 125.0}
CPU_TFLOPS = 0.1


def model_flops_per_token(spec: JobSpec, recompute: str = "none") -> float:
    """Model FLOPs per token (recompute not counted, as MFU wants); with the job's ``memory.recompute`` as
    ``recompute``, the hardware FLOPs (HFU) its recomputed forwards add."""
    m = spec.model
    params = sum(stage_params(spec, stage=0, n_stages=1)) + active_expert_params(spec)  # the model as one stage
    blocks = m.n_layers + len(mtp_layers(spec))  # the MTP depths' attention too (model.mtp_layers)
    return flops_per_token(params, blocks, m.d_model, m.seq_len, recompute)


def active_expert_params(spec: JobSpec) -> float:
    """The routed-expert parameters one token's compute goes through (``stage_params`` leaves routed experts
    out): per MoE layer ``k`` experts under a token-choice router, ``capacity_factor`` on average under
    expert choice (each expert picks its tokens). 0 for a dense model."""
    moe = spec.model.moe
    if moe is None:
        return 0.0
    per_token = moe.capacity_factor if moe.router == "expert_choice" else moe.k
    layers = range(spec.model.n_layers + len(mtp_layers(spec)))  # the MTP depths' MoE layers follow the blocks
    return per_token * sum(moe_params(spec, i)[2] for i in layers) / moe.experts


def peak_flops_per_rank(spec: JobSpec, device_name: str) -> float:
    if spec.metrics.peak_tflops_per_rank is not None:
        return spec.metrics.peak_tflops_per_rank * 1e12
    for key, tflops in PEAK_TFLOPS.items():
        if key in device_name:
            return tflops * 1e12
    return CPU_TFLOPS * 1e12


def utilization(flops_per_token: float, tokens_per_s: float, peak_flops: float) -> float:
    """The share of ``peak_flops`` that ``tokens_per_s`` at ``flops_per_token`` is: MFU with the model FLOPs,
    HFU with the hardware ones. One rule for the step records, the dashboards and benchmarks/gpu.py."""
    return flops_per_token * tokens_per_s / peak_flops
