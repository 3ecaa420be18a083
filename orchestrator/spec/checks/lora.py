"""`model.lora` against the model and the layout, before any actor starts: targets that match no Linear, NF4
blocks, adapter dropout under tensor parallelism."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from orchestrator.spec.lora import _linear_names, _row_parallel, default_targets

if TYPE_CHECKING:
    pass


def check_lora(job) -> None:
    """Refuse LoRA settings that cannot work with this model and layout, before any actor starts."""
    lora, par = job.model.lora, job.parallel
    if lora is None:
        return
    from workers.model.lora import target_names

    names, gpt = _linear_names(job.model)
    found = target_names(gpt, lora.targets)
    for i, (pattern, hits) in enumerate(found.items()):
        if not hits:
            raise SpecError(
                f"model.lora.targets[{i}]", pattern, "matches no Linear layer of the model",
                f"use module names or globs such as {', '.join(default_targets(job.model.arch))}, 'output', "
                "'layers.0.*'; "
                f"Linear layers: {', '.join(names[:7])}, ...",
            )
    if lora.quantize == "nf4":
        _check_nf4(job, gpt, sorted({n for hits in found.values() for n in hits}))
    if lora.dropout > 0 and par.grid.tp_enabled:
        raise SpecError(
            "model.lora.dropout", lora.dropout,
            f"with parallel.tp={par.tp} is not supported: each tensor-parallel rank would drop different inputs "
            "of the replicated adapter and its copies would drift apart",
            "set model.lora.dropout: 0, or parallel.tp: 1",
        )


def _check_nf4(job, gpt, adapted: list[str]) -> None:
    from workers.model.nf4 import BLOCK, shard_problem

    tp = job.parallel.tp
    for name in adapted:
        shape = tuple(gpt.get_submodule(name).weight.shape)
        if (shape[0] * shape[1]) % BLOCK:
            raise SpecError(
                "model.lora.quantize", "nf4",
                f"cannot quantize {name}: its weight {shape[0]}x{shape[1]} does not split into NF4 blocks of {BLOCK}",
                f"make model.d_model / model.d_ff / model.vocab_size multiples of {BLOCK} for that layer, "
                "remove it from model.lora.targets, or set model.lora.quantize: null",
            )
        row_parallel = _row_parallel(name, job.model.arch)
        problem = tp > 1 and shard_problem(shape, 1 if row_parallel else 0, tp)
        if problem:
            raise SpecError(
                "model.lora.quantize", "nf4",
                f"with parallel.tp={tp} cannot shard {name} ({'row' if row_parallel else 'column'}-parallel): "
                f"{problem}, so ranks would not dequantize the blocks the whole weight was quantized in",
                f"make that layer's input size (model.d_model for wo, model.d_ff for w2) a multiple of {BLOCK * tp}, "
                "remove it from model.lora.targets, or lower parallel.tp",
            )
