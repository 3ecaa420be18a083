"""The optimizer against the layout: Muon's whole matrices, and the forced kernel implementation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from workers.optim.implementations import offered

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


def check_muon(job: JobSpec) -> None:
    """Where ``optim.name: muon`` cannot orthogonalise whole matrices (workers/optim/muon.py), refused before start:
    ZeRO-1 steps flat slices of the parameters, the parameter-server shards flat chunks of them, and the offloaded
    host step is Adam's; and LoRA, where no parameter Muon would step trains (``muon_owns`` leaves adapters to
    AdamW), so the job would be AdamW under Muon's name."""
    p, off = job.parallel, job.memory.offload
    if job.optim.name != "muon":
        return
    refused = [  # (field, value, applies, why, fix)
        ("parallel.zero", p.zero, p.zero == 1 and p.dp * p.cp > 1, "steps each rank's flat slice of the "
         "parameters (workers/parallel/distributed_optimizer.py), and Muon's Newton-Schulz needs whole matrices",
         "use parallel.zero: 2 or 3 (FSDP2 shards, which Muon gathers per matrix) or 0"),
        ("parallel.dp_sync", p.dp_sync, p.dp_sync == "ps", "steps flat chunks of the parameters on the "
         "parameter-server shards, and Muon's Newton-Schulz needs whole matrices",
         "use parallel.dp_sync: allreduce with optim.name muon, or another optim.name"),
        ("memory.offload.optimizer", off.optimizer, off.optimizer, "runs an offloaded Adam step on the host, "
         "which Muon's matrices do not have", "set memory.offload.optimizer: false, or use optim.name adamw"),
        ("model.lora", "set", job.model.lora is not None, "freezes the blocks' matrices Muon steps and trains only "
         "the adapters, which get AdamW (each is a low-rank factor: orthogonalising A and B apart is not Muon's "
         "update of the product B·A, and the AdamW-matched rate is Moonlight's for whole matrices), so Muon would "
         "step nothing", "use optim.name: adamw with model.lora (the same update), or remove model.lora"),
    ]
    _refuse_first(refused, "optim.name muon")


def check_optim_implementation(job: JobSpec) -> None:
    """A forced implementation must be one the optimizer's PyTorch class takes, on a path that steps it."""
    o, p = job.optim, job.parallel
    if o.implementation == "auto":
        return
    offloaded = job.memory.offload.optimizer and o.name in ("adam", "adamw")
    choices = offered(o.name, offloaded)
    if p.dp_sync == "ps":
        raise SpecError("optim.implementation", o.implementation, "is not used under parallel.dp_sync: ps: the "
                        "parameter-server shards step the optimizer", "remove optim.implementation (auto)")
    if o.implementation in ("fused", "foreach") and p.tp > 1 and (not p.sequence_parallel or job.model.moe):
        why = "the plain norms beside" if not p.sequence_parallel else "the replicated MoE experts beside"
        raise SpecError("optim.implementation", o.implementation, f"cannot step {why} the TP-sharded DTensors: "
                        "PyTorch's multi-tensor kernels refuse a list mixing DTensors and plain tensors",
                        "use for_loop or auto" + ("" if p.sequence_parallel else
                                                  ", or parallel.sequence_parallel: true"))
    if o.implementation not in choices:
        whose = "the offloaded Adam (memory.offload.optimizer)" if offloaded else f"optim.name {o.name!r}"
        fix = (f"use one of {', '.join(choices)} or auto" if choices else
               "remove optim.implementation (auto), or use optim.name adamw, adam or sgd"
               + (" without memory.offload.optimizer" if offloaded else ""))
        raise SpecError("optim.implementation", o.implementation, f"is not offered by {whose}", fix)


def check_optim_state_dtype(job: JobSpec) -> None:
    """``optim.state_dtype: bf16`` where the device's adam/adamw steps (``workers.optim.state_dtype``), refused
    where another optimizer or path would step and silently keep its own state dtype."""
    o, p = job.optim, job.parallel
    if o.state_dtype == "fp32":
        return
    refused = [  # (field, value, applies, why, fix)
        ("optim.name", o.name, o.name not in ("adam", "adamw"), "keeps its own state (bf16 moments are adam and "
         "adamw's)", "use optim.name adamw or adam, or optim.state_dtype: fp32"),
        ("memory.offload.optimizer", True, job.memory.offload.optimizer, "steps the moments in the offload store "
         "(workers/offload/optimizer.py), which keeps them in float32", "set memory.offload.optimizer: false, or "
         "optim.state_dtype: fp32"),
        ("parallel.dp_sync", p.dp_sync, p.dp_sync == "ps", "steps the optimizer on the parameter-server shards, "
         "which keep float32 state", "use parallel.dp_sync: allreduce, or optim.state_dtype: fp32"),
        ("optim.implementation", o.implementation, o.implementation in ("fused", "foreach"), "steps one parameter "
         "at a time (PyTorch's fused and foreach kernels keep the moments in the parameter's dtype)",
         "use optim.implementation: auto or for_loop, or optim.state_dtype: fp32"),
    ]
    _refuse_first(refused, f"optim.state_dtype {o.state_dtype}")


def _refuse_first(refused: list[tuple], setting: str) -> None:
    """The first of ``refused`` (field, value, applies, why, fix) that applies, as the ``SpecError`` that says it is
    not supported with ``setting``."""
    for field, value, applies, why, fix in refused:
        if applies:
            raise SpecError(field, value, f"is not supported with {setting}: it {why}", fix)
