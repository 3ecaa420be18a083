"""``optim.implementation``: which of PyTorch's kernels an optimizer steps with (torch-free, so the spec checks
read the same table the workers build from).

PyTorch's optimizers offer up to three implementations of one update: ``for_loop`` (one parameter at a time),
``foreach`` (one multi-tensor kernel per step of the formula) and ``fused`` (the whole update in one kernel).
They compute the same update; fused and foreach round differently from the loop only in the last bits.
``auto`` picks fused for Adam, AdamW and SGD when the parameters live on CUDA (what torchtitan and Megatron run
there) and otherwise leaves PyTorch's own default (foreach on CUDA, the loop on CPU).

The multi-tensor kernels refuse a list mixing DTensors and plain tensors (torch 2.13: "got mixed torch.Tensor
and DTensor"), which a rank holds under TP without sequence parallelism (plain norms) or with an MoE
feed-forward (replicated experts): there ``auto`` steps with the loop, and a forced fused or foreach is refused
(by the spec for those layouts, here for any other).

Measured on CPU only (torch 2.13): the three agree to 1e-6 over a few steps of a tiny Llama, and fused/foreach
AdamW over FSDP2 and TP DTensors match the reference; what each is worth in speed is a GPU figure (issue 19).
"""

from __future__ import annotations

IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")

# optim.name -> the implementations its PyTorch class takes (our own optimizers and the offloaded Adam take none)
OFFERED: dict[str, tuple[str, ...]] = {
    "adamw": ("fused", "foreach", "for_loop"),
    "adam": ("fused", "foreach", "for_loop"),
    "sgd": ("fused", "foreach", "for_loop"),
    "adafactor": ("foreach", "for_loop"),
}


def offered(name: str, offloaded: bool = False) -> tuple[str, ...]:
    """The implementations ``optim.name`` can be forced to; none when its state lives in the offload store
    (``memory.offload.optimizer``: raymesh's ``OffloadedAdam`` steps it)."""
    return () if offloaded else OFFERED.get(name, ())


def kernel_kwargs(name: str, implementation: str, on_cuda: bool, mixed: bool = False) -> dict[str, bool]:
    """The ``fused``/``foreach`` arguments of ``optim.name``'s class for ``implementation`` (``on_cuda``: where
    the parameters live; ``mixed``: whether they mix DTensors and plain tensors, see the module docstring)."""
    if mixed and implementation in ("fused", "foreach"):
        raise ValueError(f"optim.implementation {implementation!r}: this rank's parameters mix DTensors and plain "
                         "tensors, which PyTorch's multi-tensor kernels refuse; use for_loop or auto")
    if implementation == "auto" and mixed:
        return {"foreach": False} if name in OFFERED else {}
    if implementation == "auto":
        return {"fused": True} if on_cuda and "fused" in OFFERED.get(name, ()) else {}
    if implementation == "fused":
        return {"fused": True}
    return {"foreach": implementation == "foreach"}
