"""`JobSpec`: a whole job file, validated section by section and then across sections."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from orchestrator.errors import SpecError
from orchestrator.spec.checks import CROSS_FIELD_CHECKS
from orchestrator.spec.fields import _SECTIONS, NAME_MAX, PathStr, _Section
from orchestrator.spec.loggers import LoggersSpec
from orchestrator.spec.messages import to_spec_error
from orchestrator.spec.model import ModelSpec
from orchestrator.spec.raw import apply_overrides
from orchestrator.spec.sections import (
    CheckpointSpec,
    ControlSpec,
    DataSpec,
    EvalSpec,
    FaultSpec,
    FaultToleranceSpec,
    MemorySpec,
    MetricsSpec,
    OptimSpec,
    ParallelSpec,
    ParameterServerSpec,
    PlanSpec,
    PrecisionSpec,
    TrainSpec,
    recompute_plan,
)
from orchestrator.spec.unset import as_unset, fill_cpu_defaults, unset_fields
from workers.parallel.partition import even_split
from workers.storage import is_url, location, staging_dir


class JobSpec(_Section):
    """A whole job file. Build it with `from_dict` or `load_spec` to get `SpecError`s."""

    _unset: frozenset[str] = PrivateAttr(default=frozenset())

    _picked_defaults: dict = PrivateAttr(default_factory=dict)

    # a directory name (runs/<name>) and a file name (<name>.json), so at most NAME_MAX less the suffix
    name: Annotated[str, Field(min_length=1, max_length=NAME_MAX - len(".json"), pattern=r"^[A-Za-z0-9._-]+$")] = (
        "raymesh-job")
    run_dir: PathStr | None = None
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    optim: OptimSpec = Field(default_factory=OptimSpec)
    precision: PrecisionSpec = Field(default_factory=PrecisionSpec)
    memory: MemorySpec = Field(default_factory=MemorySpec)
    plan: PlanSpec = Field(default_factory=PlanSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    control: ControlSpec = Field(default_factory=ControlSpec)
    fault_tolerance: FaultToleranceSpec = Field(default_factory=FaultToleranceSpec)
    faults: list[FaultSpec] = Field(default_factory=list)
    parameter_server: ParameterServerSpec = Field(default_factory=ParameterServerSpec)
    loggers: LoggersSpec = Field(default_factory=LoggersSpec)

    def resolved_run_dir(self) -> Path:
        """Where the run's files are written: `run_dir` when set, else `runs/<name>`. For an object-store URL
        this is its local staging directory, copied up by `orchestrator.observability.remote_run_dir`."""
        if self.run_dir is None:
            return Path("runs") / self.name
        return staging_dir(self.run_dir) if is_url(self.run_dir) else location(self.run_dir)

    def run_dir_url(self) -> str | None:
        """`run_dir` when it is an object-store URL (its files are staged locally and uploaded), else None."""
        return self.run_dir if self.run_dir is not None and is_url(self.run_dir) else None

    def checkpoint_dir(self) -> Path:
        """`checkpoint.dir`, else `<run_dir>/checkpoints`: in the bucket itself for a URL run_dir (DCP writes
        there directly, never through the staging directory)."""
        return self.checkpoint.resolved_dir(self.run_dir_url() or self.resolved_run_dir())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        """Validate a raw job dict; every failure becomes a `SpecError`."""
        if not isinstance(data, Mapping):
            raise SpecError(
                None,
                data,
                "is not a mapping of sections",
                "write the job as `section:` blocks, e.g. `data:` / `  path: data/tiny`",
            )
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            error = to_spec_error(exc, cls)
        raise error  # raised outside `except` so no pydantic traceback is chained

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict that `from_dict` accepts (the checkpoint flag is emitted as `async`; the fields left
        for raymesh to pick as unset, ``null``)."""
        return as_unset(self.model_dump(mode="json", by_alias=True), self.unset_fields)

    def worker_dict(self) -> dict[str, Any]:
        """`to_dict` with derived values filled in (`model.d_ff`, `parallel.virtual_stages`, the padded vocab,
        `memory.recompute: sqrt` as the policy and interval it runs, `parallel.pp_split` as layer counts per stage:
        `stage_split`, so an `auto` split is pinned by the planner first).

        Workers never import the orchestrator, so they get a plain dict with no defaults left to derive, and parse
        it with the section classes these sections subclass (``workers.spec.WorkerSpec``), which refuse a field left
        out.
        """
        out = self.model_dump(mode="json", by_alias=True)  # the values the unset fields hold, not null
        out["model"]["d_ff"] = self.model.ffn_dim
        out["model"]["vocab_size"] = self.padded_vocab_size
        out["parallel"]["virtual_stages"] = self.parallel.stages_per_rank
        out["parallel"]["pp_split"] = list(self.stage_split)
        mem = self.memory
        out["memory"]["recompute"], out["memory"]["recompute_every"] = recompute_plan(
            mem.recompute, mem.recompute_every, self.model.n_layers)
        return out

    @property
    def stage_split(self) -> tuple[int, ...]:
        """Layers per pipeline stage, virtual stages included: a `parallel.pp_split` list as given, else an even
        split. `auto` over several stages is the planner's to resolve: it profiles the model
        (`orchestrator.planning.stage_split.pin_split`, which the controller and the commands call before anything
        reads the split), so an unresolved one is refused here rather than guessed."""
        p = self.parallel
        n_stages = p.n_stages
        if isinstance(p.pp_split, list):
            return tuple(p.pp_split)
        if p.pp_split == "auto" and n_stages > 1:
            raise ValueError("parallel.pp_split 'auto' is not resolved yet: pin it first with "
                             "orchestrator.planning.stage_split.pin_split(spec), which profiles the model and writes "
                             "one layer count per stage")
        return even_split(self.model.n_layers, n_stages)

    @property
    def padded_vocab_size(self) -> int:
        """The rows the model's embedding and head get: `model.vocab_size` rounded up to a multiple of
        `parallel.tp`, which shards the vocabulary. Padded ids never occur in the data, so they are never
        targeted; the single-process reference builds the same padded model, so parity holds."""
        tp = self.parallel.tp
        return -(-self.model.vocab_size // tp) * tp

    def with_overrides(self, overrides: Iterable[str]) -> JobSpec:
        """A new validated copy with `key.path=value` overrides applied (paths kept verbatim)."""
        return JobSpec.from_dict(apply_overrides(self.to_dict(), overrides))

    @field_validator("name")
    @classmethod
    def _name_is_not_a_relative_dir(cls, name: str) -> str:
        """`.` and `..` pass the name pattern but are not a directory of their own: `runs/..` is the current
        directory and `runs/.` the folder every job's run dir sits in, so the run's files would spill there."""
        if name in (".", ".."):
            raise SpecError("name", name, "is a relative directory name, so the run dir runs/<name> would be "
                            f"{Path('runs') / name}, not a directory of this job's own",
                            "give the job a name with a letter or digit, e.g. `name: my-job`")
        return name

    @model_validator(mode="before")
    @classmethod
    def _empty_sections_mean_defaults(cls, data: Any) -> Any:
        """`checkpoint:` with every line commented out is YAML null; treat it as an empty section."""
        if isinstance(data, dict):
            return {k: ({} if v is None and k in _SECTIONS else v) for k, v in data.items()}
        return data

    @model_validator(mode="before")
    @classmethod
    def _ints_fit_64_bits(cls, data: Any) -> Any:
        """No count, size or seed outlives a 64-bit integer (torch's, numpy's, the planner's arithmetic)."""
        for path, value in _numbers(data, (), set()):
            if not -(2**63) <= value < 2**63:
                field = ".".join(map(str, path))
                raise SpecError(field, value, "does not fit in 64 bits, so no counter, size or seed can hold it",
                                f"set `{field}` to a realistic value (the default is usually right)")
        return data

    @model_validator(mode="after")
    def _check_cross_fields(self) -> JobSpec:
        """Every cross-field check, with the fields left for raymesh to pick (``orchestrator.spec.unset``) holding
        their CPU defaults meanwhile."""
        self._unset = unset_fields(self)
        fill_cpu_defaults(self, self._unset)
        for check in CROSS_FIELD_CHECKS:
            check(self)
        return self

    @property
    def unset_fields(self) -> frozenset[str]:
        """The fields the job file left for raymesh to pick (``memory.recompute``, ``train.compile``), holding their
        CPU defaults until the controller picks on a GPU (``orchestrator.planning.fast_defaults``)."""
        return self._unset


def _numbers(node: Any, path: tuple, seen: set[int]) -> Iterable[tuple[tuple, int]]:
    """Every whole number in a raw job dict, with its key path; a container YAML aliases twice is walked once."""
    if isinstance(node, (dict, list)):
        if id(node) in seen:
            return
        seen.add(id(node))
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _numbers(value, (*path, key), seen)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _numbers(value, (*path, i), seen)
    elif isinstance(node, int) and not isinstance(node, bool):
        yield path, node
