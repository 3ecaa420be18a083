"""What a `model.arch: hf` model (a Hugging Face causal LM raymesh has no family for, `workers/model/hf_any.py`)
cannot do, refused before start.

Data parallelism and ZeRO 0-3 wrap any module; everything else reaches inside the layers and needs the family's
knowledge of them: tensor parallelism its plan, the pipeline its stage cut, context parallelism its attention,
expert parallelism its experts, LoRA its Linear names, chunked losses its head, document masks its attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec

_FIX = "train it under data parallelism and ZeRO only (parallel.dp, parallel.zero 0-3)"


def check_hf_any(job: JobSpec) -> None:
    """Refuse each setting that needs the model's architecture, naming the field, its value and the fix."""
    if job.model.arch != "hf":
        return
    p, why = job.parallel, "needs raymesh's own model family, and model.init_from's model_type " \
        f"{job.model.hf_config.get('model_type')!r} is built by transformers as it is (model.arch hf)"
    for axis in ("tp", "pp", "cp", "ep"):
        if getattr(p, axis) > 1:
            raise SpecError(f"parallel.{axis}", getattr(p, axis), why, f"set parallel.{axis}: 1 and {_FIX}")
    refusals = (("model.lora", job.model.lora is not None, "remove model.lora (train every weight)"),
                ("train.loss_chunks", job.train.loss_chunks > 1, "set train.loss_chunks: 1"),
                ("model.attention_mask", job.model.attention_mask != "causal", "set model.attention_mask: causal"),
                # its layers take keyword inputs (masks, rotary tables), which a segment's recompute cannot replay
                ("memory.recompute", job.memory.recompute == "sqrt", "set memory.recompute: full"),
                # the same: a partitioned checkpoint replays the block from its one gathered input
                ("memory.partition_activations", job.memory.partition_activations != "none",
                 "set memory.partition_activations: none"))
    for field, refused, fix in refusals:
        if refused:
            value = job.model.lora.model_dump() if field == "model.lora" else _value(job, field)
            raise SpecError(field, value, why, fix)


def _value(job: JobSpec, field: str):
    section, name = field.split(".")
    return getattr(getattr(job, section), name)
