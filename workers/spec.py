"""The job spec as a rank reads it: the sections of ``workers.contract.sections``, parsed from the dict the
controller sends.

Workers never import the orchestrator; they receive ``JobSpec.worker_dict()``, validated by the driver's
subclasses of the same section classes and with derived values filled in, and parse it here once with those
classes, so a field has one type, bound and default on both sides. The dict must carry every field of every
section a rank reads: one left out is refused by name, never filled in with a default the controller did not send.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_args

from pydantic import BaseModel

from workers.contract.mixed_precision import uses_fsdp_mixed
from workers.contract.sections import (
    DataSection,
    EvalSection,
    FaultToleranceSection,
    FineTuningSection,
    MemorySection,
    MetricsSection,
    OptimSection,
    ParallelSection,
    ParameterServerSection,
    PrecisionSection,
    TrainSection,
)
from workers.model.config import ModelConfig
from workers.model.registry import ModelFamily, family


@dataclass(frozen=True)
class WorkerSpec:
    """The sections a rank reads, each parsed by its contract class; ``model`` by the config class of the family
    ``model.arch`` names, ``finetune`` from the same ``model:`` dict (``init_from``, ``lora``). ``ps_routes``: where
    the parameter-server shards are, which the controller adds under ``dp_sync: ps``. ``data_slot``: ``(dp_rank,
    dp)`` whose share of each global batch this rank reads, where that is not its place in ``parallel``: a surviving
    replica of ``recovery: keep_training`` steps in a smaller group on the data it read in the full one."""

    parallel: ParallelSection
    train: TrainSection
    data: DataSection
    eval: EvalSection
    precision: PrecisionSection
    memory: MemorySection
    optim: OptimSection
    parameter_server: ParameterServerSection
    metrics: MetricsSection
    fault_tolerance: FaultToleranceSection
    model: ModelConfig
    finetune: FineTuningSection
    ps_routes: dict[str, Any] | None = None
    data_slot: tuple[int, int] | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> WorkerSpec:
        """Each section of ``raw`` (the dict ``JobSpec.worker_dict()`` builds) through its class; a missing field
        raises ``KeyError`` naming it."""
        sections = {name: _parse(kind, raw, name) for name, kind in SECTIONS.items()}
        if "arch" not in _member(raw, "model"):
            raise KeyError(f"worker spec field model.arch is missing; {_FIX}")
        shape = family(raw["model"]["arch"]).config
        return cls(**sections, model=_parse(shape, raw, "model"), finetune=_parse(FineTuningSection, raw, "model"),
                   ps_routes=raw.get("ps_routes"),
                   data_slot=tuple(raw["data_slot"]) if raw.get("data_slot") is not None else None)

    @property
    def model_family(self) -> ModelFamily:
        """The registered family of ``model.arch``: the builder's hooks and recompute targets come from it."""
        return family(self.model.arch)

    def fsdp_mixed(self, on_cuda: bool) -> bool:
        """Whether bf16 runs through FSDP2's mixed-precision policy here (``workers.contract.mixed_precision``)."""
        p = self.parallel
        return uses_fsdp_mixed(self.precision.dtype, self.precision.policy, p.zero, p.dp_sync, on_cuda)


# the fields of WorkerSpec parsed from the section of the same name
SECTIONS = {"parallel": ParallelSection, "train": TrainSection, "data": DataSection, "eval": EvalSection,
            "precision": PrecisionSection, "memory": MemorySection, "optim": OptimSection,
            "parameter_server": ParameterServerSection, "metrics": MetricsSection,
            "fault_tolerance": FaultToleranceSection}


def _member(raw: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """Section ``name`` of ``raw``; a dict without it is refused by name rather than read as all defaults."""
    section = raw.get(name)
    if not isinstance(section, Mapping):
        raise KeyError(f"worker spec section {name} is missing; {_FIX}")
    return section


_FIX = ("build the dict with JobSpec.from_dict(job).worker_dict(), which writes every field; a rank takes no "
        "default the controller did not send")


def _parse(kind: type[BaseModel], raw: Mapping[str, Any], name: str) -> BaseModel:
    """``raw[name]`` as ``kind``: every field ``kind`` declares must be there (``_missing``); the fields it does not
    declare are the controller's (``metrics.port``, ``model.preset``) and are left out."""
    values = _member(raw, name)
    missing = _missing(kind, values, name)
    if missing is not None:
        raise KeyError(f"worker spec field {missing} is missing; {_FIX}")
    return kind.model_validate({key: values[key] for key in _keys(kind)})


def _keys(kind: type[BaseModel]) -> list[str]:
    """The dict keys of ``kind``'s fields (their job-file aliases where they have one)."""
    return [info.alias or name for name, info in kind.model_fields.items()]


def _missing(kind: type[BaseModel], values: Mapping[str, Any], where: str) -> str | None:
    """The first field of ``kind`` (and of the sections nested in it: ``memory.offload``, ``model.moe``) that
    ``values`` leaves out, as a dotted job-file path; None when every one is there."""
    for key, info in zip(_keys(kind), kind.model_fields.values(), strict=True):
        if key not in values:
            return f"{where}.{key}"
        nested = _section_class(info.annotation)
        value = values[key]
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items if nested is not None else ()):
            if isinstance(item, Mapping):
                found = _missing(nested, item, f"{where}.{key}" + (f"[{i}]" if isinstance(value, list) else ""))
                if found is not None:
                    return found
    return None


def _section_class(annotation: Any) -> type[BaseModel] | None:
    """The section class in a field's annotation (``OffloadSection``, ``MoEConfig | None``, ``list[MixSource]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((c for c in map(_section_class, get_args(annotation)) if c is not None), None)
