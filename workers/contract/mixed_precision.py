"""Which 16-bit scheme a rank runs for ``precision.dtype: bf16``: FSDP2's mixed-precision policy, or autocast.

Torch-free, so the planner (``orchestrator/planning``) resolves the policy with the same rule the ranks do.

- **FSDP2's policy** (``MixedPrecisionPolicy``): the all-gathered (unsharded) parameters are bf16, so the whole
  forward and backward computes in bf16 and saves bf16 activations; gradients are reduced in
  ``precision.reduce_dtype`` (fp32 by default) and land on the sharded fp32 parameters, which the optimizer
  steps as master weights. What torchtitan runs on GPUs. Needs FSDP2's units, so ZeRO-2/3 with all-reduce sync.
- **autocast** over fp32 weights: each op casts its inputs, and autograd keeps every cast weight for backward.
  Works with every layout (ZeRO-0/1, the parameter-server sync, fp16 with loss scaling).

``precision.policy: auto`` takes FSDP2's policy where it applies on a GPU and autocast elsewhere: the CPU
layouts the parity suite and the planner's memory figures were measured with keep autocast.
"""

from __future__ import annotations

REDUCE_DTYPES = ("fp32", "bf16")


def fsdp_applies(dtype: str, zero: int, dp_sync: str) -> bool:
    """Whether FSDP2's mixed-precision policy can carry this job: bf16, FSDP2 units (ZeRO-2/3), no PS shards."""
    return dtype == "bf16" and zero >= 2 and dp_sync != "ps"


def uses_fsdp_mixed(dtype: str, policy: str, zero: int, dp_sync: str, on_cuda: bool) -> bool:
    """Whether the ranks compute through FSDP2's mixed-precision policy (else autocast, or fp32)."""
    if not fsdp_applies(dtype, zero, dp_sync):
        return False
    return policy == "fsdp" or (policy == "auto" and on_cuda)


def planned_fsdp_mixed(dtype: str, policy: str, zero: int, dp_sync: str, device: str) -> bool:
    """``uses_fsdp_mixed`` as the driver (spec checks, planner) decides it from ``parallel.device``: ``auto`` is
    planned as a GPU, since the driver itself may have none."""
    return uses_fsdp_mixed(dtype, policy, zero, dp_sync, on_cuda=device != "cpu")
