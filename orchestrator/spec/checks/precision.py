"""`precision.policy` and `reduce_dtype` against the dtype and FSDP2's units."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from workers.contract.mixed_precision import fsdp_applies, planned_fsdp_mixed

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


def check_precision(job: JobSpec) -> None:
    """``precision.policy`` and ``reduce_dtype``: FSDP2's mixed-precision policy needs bf16 and FSDP2's units
    (``workers/contract/mixed_precision.py``); a field that could never take effect is refused, not ignored."""
    pr, p = job.precision, job.parallel
    if pr.policy != "auto" and pr.dtype == "fp32":
        raise SpecError("precision.policy", pr.policy, "picks how bf16 (or fp16) computes, and precision.dtype is fp32",
                        "set precision.dtype: bf16, or remove precision.policy")
    if pr.policy == "fsdp" and not fsdp_applies(pr.dtype, p.zero, p.dp_sync):
        why = (f"needs precision.dtype bf16 (fp16 needs loss scaling, which runs under autocast), not {pr.dtype!r}"
               if pr.dtype != "bf16" else
               f"needs FSDP2's units (parallel.zero 2 or 3 with dp_sync allreduce); this job has zero: {p.zero}, "
               f"dp_sync: {p.dp_sync}")
        raise SpecError("precision.policy", "fsdp", why, "set parallel.zero: 2 or 3 (dp_sync: allreduce) with "
                        "precision.dtype: bf16, or precision.policy: autocast")
    if pr.reduce_dtype != "fp32" and not planned_fsdp_mixed(pr.dtype, pr.policy, p.zero, p.dp_sync, p.device):
        raise SpecError("precision.reduce_dtype", pr.reduce_dtype, "is the gradient reduction dtype of FSDP2's "
                        "mixed-precision policy, which this job does not run (it needs precision.dtype bf16, "
                        "parallel.zero 2 or 3, and precision.policy fsdp, or auto on a GPU)",
                        "remove precision.reduce_dtype, or set precision.policy: fsdp with zero 2 or 3 (ZeRO-0 "
                        "compresses its buckets with parallel.grad_compression: bf16)")
    check_grad_reduce_dtype(job)
    check_param_gather_dtype(job)


def check_grad_reduce_dtype(job: JobSpec) -> None:
    """``parallel.grad_reduce_dtype`` reduces ZeRO 1-3's gradients; a job where it would do nothing is refused."""
    pr, p = job.precision, job.parallel
    if p.grad_reduce_dtype == "fp32":
        return
    if p.zero == 0 or p.dp_sync != "allreduce":
        raise SpecError("parallel.grad_reduce_dtype", p.grad_reduce_dtype, "reduces sharded data parallelism's "
                        f"gradients (zero 1-3 with dp_sync allreduce); this job has zero: {p.zero}, dp_sync: "
                        f"{p.dp_sync}", "set parallel.zero: 1, 2 or 3, or for ZeRO-0 use parallel.grad_compression: "
                        "bf16 instead")
    if planned_fsdp_mixed(pr.dtype, pr.policy, p.zero, p.dp_sync, p.device):
        raise SpecError("parallel.grad_reduce_dtype", p.grad_reduce_dtype, "would be overruled: this job runs "
                        "FSDP2's bf16 policy, whose reduction dtype is precision.reduce_dtype",
                        "remove parallel.grad_reduce_dtype and set precision.reduce_dtype: bf16")


def check_param_gather_dtype(job: JobSpec) -> None:
    """``parallel.param_gather_dtype`` quantizes ZeRO-1's all-gather of the updated slices (distributed_optimizer.py)
    and FSDP2's parameter all-gathers at ZeRO-2/3 (fsdp_quantized_gather.py, FSDP2's all-gather extensions); without
    sharded data parallelism nothing is gathered. Refused, not ignored, where the gather extension cannot reach the
    parameters (tensor-parallel DTensors, compiled blocks, parameters offloaded to the host)."""
    p = job.parallel
    if p.param_gather_dtype == "fp32":
        return
    if p.zero == 0 or p.dp_sync != "allreduce":
        raise SpecError("parallel.param_gather_dtype", p.param_gather_dtype, "quantizes sharded data parallelism's "
                        f"parameter all-gather, which this job does not run (zero: {p.zero}, dp_sync: {p.dp_sync})",
                        "set parallel.zero: 1, 2 or 3 with dp_sync: allreduce, or remove parallel.param_gather_dtype")
    if p.dp * p.cp < 2:
        raise SpecError("parallel.param_gather_dtype", p.param_gather_dtype, "has no all-gather to quantize: "
                        "one data-parallel rank holds every slice", "remove parallel.param_gather_dtype, or set "
                        "parallel.dp: 2 or more")
    if p.zero >= 2:
        _check_fsdp_gather(job)


def _check_fsdp_gather(job: JobSpec) -> None:
    """ZeRO-2/3's quantized gathers wrap each plain fp32 parameter before ``fully_shard``; what keeps them from it."""
    p = job.parallel
    blocked = [("parallel.tp", p.tp, p.tp > 1, "tensor-parallel parameters are DTensors, which the gather does not "
                "wrap", "set parallel.tp: 1, or parallel.zero: 1 (whose gather covers tp shards)"),
               ("train.compile", job.train.compile, bool(job.train.compile), "compiled blocks would trace the "
                "gather's tensor subclass", "remove train.compile, or parallel.param_gather_dtype"),
               ("memory.offload.params", job.memory.offload.params, bool(job.memory.offload.params), "host-offloaded "
                "shards are copied to the device by FSDP2 outside the gather hooks", "remove memory.offload.params, "
                "or parallel.param_gather_dtype")]
    for field, value, bad, why, fix in blocked:
        if bad:
            raise SpecError(field, value, f"cannot combine with parallel.param_gather_dtype: "
                            f"{p.param_gather_dtype} at zero {p.zero}: {why}", fix)


def check_float8(job: JobSpec) -> None:
    """``precision.float8`` where torchao's float8 linears would not be what trains: LoRA's wrapped base layers
    (frozen, adapters too narrow for float8 GEMMs), and fp16, whose loss scaling float8's own scales fight.
    A GPU without FP8 matmuls is refused by the ranks (``workers.model.float8.check_float8_device``)."""
    pr = job.precision
    if pr.float8 == "none":
        return
    if job.model.lora is not None:
        raise SpecError("precision.float8", pr.float8, "cannot combine with model.lora: the blocks' linear layers "
                        "are LoRA wrappers over frozen (or NF4) base weights, which torchao's float8 training does "
                        "not swap", "remove precision.float8 (LoRA's adapters are too small to gain from it), or "
                        "model.lora")
    if pr.dtype == "fp16":
        raise SpecError("precision.float8", pr.float8, "cannot combine with precision.dtype fp16: float8's "
                        "dynamic scales and fp16's loss scaling would both rescale the gradients",
                        "use precision.dtype: bf16 (float8 training's usual partner), or precision.float8: none")

