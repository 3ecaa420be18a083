"""``optim.implementation``: which of PyTorch's kernels an optimizer steps with (torch-free, so the spec checks
read the same table the workers build from).

PyTorch's optimizers offer up to three implementations of one update: ``for_loop`` (one parameter at a time),
``foreach`` (one multi-tensor kernel per step of the formula) and ``fused`` (the whole update in one kernel).
They compute the same update; fused and foreach round differently from the loop only in the last bits.
``auto`` picks fused for Adam, AdamW and SGD when the parameters live on CUDA (what torchtitan and Megatron run
there) and otherwise leaves PyTorch's own default (foreach on CUDA, the loop on CPU and for DTensors).
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


def kernel_kwargs(name: str, implementation: str, on_cuda: bool) -> dict[str, bool]:
    """The ``fused``/``foreach`` arguments of ``optim.name``'s class for ``implementation`` (``on_cuda``: where
    the parameters live, which ``auto`` reads)."""
    if implementation == "auto":
        return {"fused": True} if on_cuda and "fused" in OFFERED.get(name, ()) else {}
    if implementation == "fused":
        return {"fused": True}
    return {"foreach": implementation == "foreach"}
