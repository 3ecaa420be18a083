"""Job-file spec: YAML -> validated `JobSpec`.

A job file is YAML with optional sections (`model`, `data`, `parallel`, `optim`,
`precision`, `memory`, `train`, `checkpoint`) plus top-level `name` and
`run_dir`; only `data.path` is required. Everything that can be checked without
touching the cluster or the data is checked here, so a bad job fails before
any Ray actor starts, with a `SpecError` that names the field, the value and a
fix.

Path rule: `load_spec` resolves relative `data.path`, `run_dir` and
`checkpoint.dir` (from the file or from overrides) against the CURRENT WORKING
DIRECTORY, not the job file's directory. That is what `ray job submit
--working-dir .` needs: the driver runs inside the uploaded copy of the
directory the user submitted from. `JobSpec.from_dict` and `with_overrides`
keep paths verbatim, because they are used to pass an already resolved spec
between processes.
"""

from __future__ import annotations

import copy
import difflib
import itertools
import types
import typing
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from orchestrator.errors import NO_VALUE, SpecError
from orchestrator.lora_spec import LoraSpec, check_lora
from orchestrator.memory_model import parse_bytes
from orchestrator.soak import check_repetition
from workers.layout import V_SHAPED

# schedules that split backward into input- and weight-gradient passes
_SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv", "dualpipev")

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Beta = Annotated[float, Field(ge=0, lt=1)]

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev"]
_SINGLE_STAGE = ("gpipe", "1f1b")
_INTERLEAVED = ("interleaved_1f1b", "interleaved_zero_bubble")
_SECTIONS = ("model", "data", "parallel", "optim", "precision", "memory", "train", "checkpoint", "metrics", "fault_tolerance",
             "parameter_server")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _near_multiples(n: int, k: int) -> list[int]:
    """Multiples of `k` just below and above `n`, as concrete suggestions."""
    below = n // k * k
    return [m for m in (below, below + k) if m > 0]


class _Section(BaseModel):
    """Base for every section: unknown keys are errors, never silently ignored."""

    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Section):
    """Transformer shape."""

    vocab_size: PositiveInt = 256
    d_model: PositiveInt = 64
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 4
    d_ff: PositiveInt | None = None
    seq_len: PositiveInt = 64
    positions: Literal["rotary", "learned"] = "rotary"
    norm_eps: PositiveFloat = 1e-5
    init_std: PositiveFloat = 0.02
    lora: LoraSpec | None = None  # LoRA/QLoRA fine-tuning; null: train every weight

    @property
    def ffn_dim(self) -> int:
        """Feed-forward width; `d_ff` when given, else the usual 4 * d_model."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @model_validator(mode="after")
    def _check_heads(self) -> ModelSpec:
        if self.d_model % self.n_heads:
            raise SpecError(
                "model.n_heads",
                self.n_heads,
                f"does not divide model.d_model={self.d_model}",
                f"pick n_heads from {_divisors(self.d_model)}, or make d_model a multiple of {self.n_heads}",
            )
        if self.positions == "rotary" and self.head_dim % 2:
            even = [h for h in _divisors(self.d_model) if (self.d_model // h) % 2 == 0]
            raise SpecError(
                "model.n_heads",
                self.n_heads,
                f"gives an odd head_dim d_model/n_heads = {self.d_model}/{self.n_heads} = {self.head_dim}, "
                "which rotary positions cannot rotate in pairs",
                f"pick n_heads from {even}, or set model.positions: learned",
            )
        return self


class DataSpec(_Section):
    """Where the prepared token shards live (see `raymesh prepare-data`)."""

    path: Annotated[str, Field(min_length=1)]
    seed: int = 0


class ParallelSpec(_Section):
    """Mesh shape and placement; world size is dp * pp * tp ranks."""

    dp: Annotated[int, Field(ge=1)] = 1
    pp: Annotated[int, Field(ge=1)] = 1
    tp: Annotated[int, Field(ge=1)] = 1
    zero: Literal[0, 1, 2, 3] = 0
    pp_schedule: PipelineSchedule = "1f1b"
    virtual_stages: Annotated[int, Field(ge=1)] | None = None
    sequence_parallel: bool = True
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cpus_per_rank: PositiveFloat = 1.0
    dp_sync: Literal["allreduce", "ps"] = "allreduce"  # ps: parameter-server shards (`parameter_server:` section)
    # bytes per device for the planner's fit check (`80GB`, `80GiB` or a number); default: the GPU's own
    device_memory: int | str | None = None

    @property
    def device_memory_bytes(self) -> int | None:
        return None if self.device_memory is None else parse_bytes(self.device_memory)

    @model_validator(mode="after")
    def _check_device_memory(self) -> ParallelSpec:
        if self.device_memory is not None:
            try:
                parse_bytes(self.device_memory)
            except ValueError:
                raise SpecError("parallel.device_memory", self.device_memory, "is not a size",
                                "write bytes with a unit, e.g. 80GB (decimal), 80GiB (binary) or 85899345920") from None
        return self

    @property
    def stages_per_rank(self) -> int:
        """Model chunks per pp rank: `virtual_stages`, else 1 for gpipe/1f1b and 2 otherwise."""
        if self.virtual_stages is not None:
            return self.virtual_stages
        return 1 if self.pp_schedule in _SINGLE_STAGE else 2

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @model_validator(mode="after")
    def _check_virtual_stages(self) -> ParallelSpec:
        v, schedule = self.virtual_stages, self.pp_schedule
        if v is None:
            return self
        if schedule in _SINGLE_STAGE and v != 1:
            raise SpecError(
                "parallel.virtual_stages",
                v,
                f"is not supported by pp_schedule {schedule!r}, which runs one stage per pp rank",
                "remove virtual_stages, or use pp_schedule: interleaved_1f1b for several stages per rank",
            )
        if schedule in _INTERLEAVED and v < 2:
            raise SpecError(
                "parallel.virtual_stages",
                v,
                f"is too small: pp_schedule {schedule!r} needs at least 2 stages per pp rank",
                "set virtual_stages to 2 or more (or remove it; the default is 2), or use pp_schedule: 1f1b",
            )
        if schedule in V_SHAPED and v != 2:
            raise SpecError(
                "parallel.virtual_stages",
                v,
                f"is not allowed: pp_schedule {schedule!r} runs exactly 2 stages per pp rank (V shape)",
                "set virtual_stages: 2, or remove it",
            )
        return self


class OptimSpec(_Section):
    """Optimizer and learning-rate schedule."""

    # adafactor: PyTorch's; sm3: ours (workers/sm3.py); paged_adamw: AdamW with its state in the offload store
    name: Literal["adamw", "adam", "sgd", "adafactor", "sm3", "paged_adamw"] = "adamw"
    lr: PositiveFloat = 3e-3
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.0
    grad_clip: Annotated[float, Field(ge=0)] = 1.0  # 0 disables clipping
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1


class PrecisionSpec(_Section):
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    initial_loss_scale: PositiveFloat = 65536.0


class OffloadSpec(_Section):
    """What leaves the device for the offload store (workers/offload/), and which tier holds it."""

    optimizer: bool = False  # Adam moments (+ fp32 master weights off the host) live in the store
    params: bool = False  # ZeRO-3 parameter shards live in the store between uses (needs optimizer offload)
    activations: bool = False  # saved activations go to the store in forward, come back for backward
    tier: Literal["cpu", "nvme"] = "cpu"
    path: str | None = None  # directory for nvme files (required for tier nvme)
    prefetch: Annotated[int, Field(ge=0)] = 1  # items fetched ahead of use


class MemorySpec(_Section):
    recompute: Literal["none", "selective", "full"] = "none"
    offload: OffloadSpec = Field(default_factory=OffloadSpec)
    activation_compression: Literal["none", "bf16", "fp8"] = "none"  # lossy: saved activations kept in this dtype
    measure: bool = False  # each rank measures its tensor bytes per category; the summary's `memory` compares them


class TrainSpec(_Section):
    """Loop length and batching.

    `microbatches` is gradient-accumulation steps per data rank when pp == 1,
    and pipeline microbatches when pp > 1.
    """

    steps: PositiveInt = 100
    global_batch_size: PositiveInt = 16
    microbatches: PositiveInt = 1
    seed: int = 0
    log_every: PositiveInt = 1


class CheckpointSpec(_Section):
    """Checkpoint cadence; `every: 0` never checkpoints. YAML key `async` maps to `async_save`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    every: Annotated[int, Field(ge=0)] = 0
    dir: str | None = None
    async_save: bool = Field(default=False, alias="async")
    keep: Annotated[int, Field(ge=1)] = 3
    memory_every: Annotated[int, Field(ge=0)] = 10  # in-memory snapshot (+ replica on a peer) cadence; 0: off

    def resolved_dir(self, run_dir: str | Path) -> Path:
        """`dir` when set, else `<run_dir>/checkpoints`."""
        return Path(self.dir) if self.dir is not None else Path(run_dir) / "checkpoints"


class FaultToleranceSpec(_Section):
    """How failures are detected and how many restarts a job may spend."""

    heartbeat_timeout_s: Annotated[float, Field(gt=0)] = 120.0  # a step not answered by then: the rank hung
    collective_timeout_s: Annotated[float, Field(gt=0)] = 60.0  # survivors' collectives with a dead peer give up
    max_restarts: Annotated[int, Field(ge=0)] = 3
    # replace_failed: new actors for the failed ranks only, state from memory (else disk); restart_all: every
    # rank torn down and restarted from the last disk checkpoint, as Ray Train and torchrun do (a baseline)
    recovery: Literal["replace_failed", "restart_all"] = "replace_failed"
    straggler_ratio: Annotated[float, Field(gt=1)] = 1 / 0.7  # step time over the other ranks' median
    straggler_steps: Annotated[int, Field(ge=1)] = 3  # consecutive steps above the ratio before it is reported
    # elastic data parallelism: a replacement not started by then (its node is gone) shrinks dp instead
    placement_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    min_dp: Annotated[int, Field(ge=1)] = 1  # never shrink below this many data-parallel replicas
    grow_check_s: Annotated[float, Field(gt=0)] = 30.0  # below the requested dp, look for room this often


class ParameterServerSpec(_Section):
    """Parameter-server shards, used when `parallel.dp_sync: ps` (see parameter_server/)."""

    shards: PositiveInt = 2
    consistency: Literal["bsp", "asp", "ssp"] = "bsp"
    staleness: Annotated[int, Field(ge=0)] = 2  # ssp: a worker at clock c reads once the slowest reached c - staleness
    transport: Literal["ray", "grpc"] = "ray"  # how workers reach shards; gRPC is served either way
    optimizer: Literal["sgd", "momentum", "adam", "adamw"] | None = None  # None: optim.name
    chunk_elems: PositiveInt = 65536  # tensors are cut into chunks of at most this many elements
    virtual_nodes: PositiveInt = 64  # points per shard on the consistent-hash ring
    snapshot_every: Annotated[int, Field(ge=0)] = 0  # steps between shard snapshots to <run_dir>/ps; 0: off

    def server_optim(self, optim: OptimSpec) -> dict:
        """What each shard's optimizer is built from."""
        return {"name": self.optimizer or optim.name, "lr": optim.lr, "weight_decay": optim.weight_decay,
                "betas": list(optim.betas), "momentum": optim.momentum}


class FaultSpec(_Section):
    """One injected fault (the fault-injection harness): deterministic by step and rank (or shard)."""

    kind: Literal["kill_rank", "kill_node", "hang_rank", "slow_rank", "nan_loss", "corrupt_checkpoint",
                  "kill_ps_shard"]
    rank: int | str = 0  # or `random`: drawn by seed (repeating faults only); checked by JobSpec._check_faults
    shard: Annotated[int, Field(ge=0)] = 0  # kill_ps_shard: which parameter-server shard dies
    at_step: Annotated[int, Field(ge=1)] | None = None  # a one-shot fault's step
    factor: Annotated[float, Field(gt=1)] = 3.0  # slow_rank: its steps take this many times as long
    every_s: Annotated[float, Field(gt=0)] | None = None  # instead of at_step: fire again every this many seconds
    jitter_s: Annotated[float, Field(ge=0)] = 0.0  # each gap is every_s plus uniform(-jitter_s, jitter_s)
    seed: int = 0  # draws the gaps and random ranks of a repeating fault


class MetricsSpec(_Section):
    """The controller's Prometheus endpoint and what the run records for reports."""

    port: Annotated[int, Field(ge=0, le=65535)] | None = None  # None: no endpoint; 0: any free port
    file_sd: str | None = None  # Prometheus file_sd target file; default runs/prometheus_targets/<run_dir name>.json
    timeline: bool = False  # record every pipeline F/B/W event for `raymesh report`
    peak_tflops_per_rank: Annotated[float, Field(gt=0)] | None = None  # for MFU; default by device

    def resolved_file_sd(self, run_dir: str | Path) -> Path:
        """One shared folder beside the run dirs: Prometheus globs only a path's last element."""
        if self.file_sd is not None:
            return Path(self.file_sd)
        return Path(run_dir).parent / "prometheus_targets" / f"{Path(run_dir).name}.json"


class JobSpec(_Section):
    """A whole job file. Build it with `from_dict` or `load_spec` to get `SpecError`s."""

    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")] = "raymesh-job"
    run_dir: str | None = None
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    optim: OptimSpec = Field(default_factory=OptimSpec)
    precision: PrecisionSpec = Field(default_factory=PrecisionSpec)
    memory: MemorySpec = Field(default_factory=MemorySpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    fault_tolerance: FaultToleranceSpec = Field(default_factory=FaultToleranceSpec)
    faults: list[FaultSpec] = Field(default_factory=list)
    parameter_server: ParameterServerSpec = Field(default_factory=ParameterServerSpec)

    def resolved_run_dir(self) -> Path:
        """`run_dir` when set, else `runs/<name>`."""
        return Path(self.run_dir) if self.run_dir is not None else Path("runs") / self.name

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
            error = _to_spec_error(exc)
        raise error  # raised outside `except` so no pydantic traceback is chained

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict that `from_dict` accepts (the checkpoint flag is emitted as `async`)."""
        return self.model_dump(mode="json", by_alias=True)

    def worker_dict(self) -> dict[str, Any]:
        """`to_dict` with derived values filled in (`model.d_ff`, `parallel.virtual_stages`).

        Workers never import the orchestrator, so they get a plain dict with no defaults left to derive.
        """
        out = self.to_dict()
        out["model"]["d_ff"] = self.model.ffn_dim
        out["parallel"]["virtual_stages"] = self.parallel.stages_per_rank
        return out

    def with_overrides(self, overrides: Iterable[str]) -> JobSpec:
        """A new validated copy with `key.path=value` overrides applied (paths kept verbatim)."""
        return JobSpec.from_dict(apply_overrides(self.to_dict(), overrides))

    @model_validator(mode="before")
    @classmethod
    def _empty_sections_mean_defaults(cls, data: Any) -> Any:
        """`checkpoint:` with every line commented out is YAML null; treat it as an empty section."""
        if isinstance(data, dict):
            return {k: ({} if v is None and k in _SECTIONS else v) for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _check_cross_fields(self) -> JobSpec:
        self._check_pipeline_split()
        self._check_tensor_split()
        self._check_batching()
        self._check_zero()
        self._check_faults()
        self._check_parameter_server()
        self._check_offload()
        check_lora(self)
        return self

    def _check_parameter_server(self) -> None:
        """What `dp_sync: ps` cannot combine with, and `kill_ps_shard` faults."""
        p, ps = self.parallel, self.parameter_server
        kills = [i for i, f in enumerate(self.faults) if f.kind == "kill_ps_shard"]
        if p.dp_sync != "ps":
            if kills:
                raise SpecError(f"faults.{kills[0]}.kind", "kill_ps_shard", "needs parameter-server shards",
                                "set parallel.dp_sync: ps, or remove the fault")
            return
        unsupported = [
            ("parallel.zero", p.zero, p.zero > 0, "the shards already hold the only optimizer state",
             "set parallel.zero: 0"),
            ("parallel.tp", p.tp, p.tp > 1, "tensor-parallel shards of a parameter are not keyed separately yet",
             "set parallel.tp: 1, or parallel.dp_sync: allreduce"),
            ("precision.dtype", self.precision.dtype, self.precision.dtype == "fp16",
             "a skipped fp16 step would leave the shards waiting for its push", "use bf16 or fp32"),
            ("parameter_server.consistency", ps.consistency, ps.consistency != "bsp" and p.pp > 1,
             "asynchronous rounds run one stage per worker", "use consistency: bsp with pipeline parallelism, or pp: 1"),
        ]
        for field, value, bad, why, fix in unsupported:
            if bad:
                raise SpecError(field, value, f"is not supported with parallel.dp_sync: ps ({why})", fix)
        if ps.optimizer == "momentum" and self.optim.momentum == 0:
            raise SpecError("parameter_server.optimizer", "momentum", "needs optim.momentum > 0",
                            "set optim.momentum (e.g. 0.9), or optimizer: sgd")
        for i, f in enumerate(self.faults):
            if f.kind in ("kill_rank", "kill_node", "hang_rank", "nan_loss"):
                raise SpecError(f"faults.{i}.kind", f.kind, "is not recoverable with parallel.dp_sync: ps (the "
                                "shards are not rolled back with the ranks)", "use slow_rank or kill_ps_shard")
            if f.kind == "kill_ps_shard" and (ps.shards < 2 or f.shard >= ps.shards):
                raise SpecError(f"faults.{i}.shard", f.shard, f"is not a shard that can die and be taken over "
                                f"(parameter_server.shards={ps.shards}; a replica needs at least 2)",
                                f"pick a shard from 0 to {ps.shards - 1} with shards >= 2")

    def _check_offload(self) -> None:
        """Offload combinations that cannot work, refused with the fix (workers/offload/)."""
        off, name, p = self.memory.offload, self.optim.name, self.parallel
        if off.tier == "nvme" and not off.path:
            raise SpecError("memory.offload.path", off.path, "is required for tier nvme (where the files go)",
                            "set memory.offload.path to a directory on a local NVMe drive, or use tier: cpu")
        if off.path and off.tier != "nvme":
            raise SpecError("memory.offload.path", off.path, f"is only used by tier nvme, not {off.tier!r}",
                            "set memory.offload.tier: nvme, or remove memory.offload.path")
        if off.optimizer and name not in ("adamw", "adam", "paged_adamw"):
            raise SpecError("memory.offload.optimizer", True, f"is not supported for optim.name {name!r}: the "
                            "offloaded host step is Adam's", "use optim.name adamw, adam or paged_adamw, "
                            "or set memory.offload.optimizer: false")
        if name == "adafactor" and (p.zero >= 2 or p.tp > 1):
            field, value = ("parallel.zero", p.zero) if p.zero >= 2 else ("parallel.tp", p.tp)
            raise SpecError(field, value, "shards parameters, which optim.name 'adafactor' (PyTorch's) cannot step "
                            "exactly: its factored second moment divides row means by column means of whole "
                            "matrices, and a shard sees only some rows or columns",
                            "use optim.name sm3 (same O(rows + cols) state, steps shards exactly), adamw with "
                            "memory.offload.optimizer or paged_adamw, or zero: 0/1 with tp: 1 for adafactor")
        stored_optim = off.optimizer or name == "paged_adamw"
        if stored_optim and p.zero == 1 and p.dp > 1:
            raise SpecError("parallel.zero", 1, "cannot be combined with an offloaded optimizer: "
                            "ZeroRedundancyOptimizer partitions state with its own inner optimizer",
                            "use zero: 2 or 3 (FSDP2; the store then holds this rank's shard only) or zero: 0")
        if off.params:
            self._check_param_offload(stored_optim)

    def _check_param_offload(self, stored_optim: bool) -> None:
        """ZeRO-3 parameter offload (workers/offload/params.py) lives on FSDP2's units; what it does not cover."""
        p = self.parallel
        if p.zero != 3 or p.dp_sync == "ps":
            field, value = ("parallel.zero", p.zero) if p.zero != 3 else ("parallel.dp_sync", p.dp_sync)
            raise SpecError(field, value, "cannot be combined with memory.offload.params: only ZeRO-3 (FSDP2, "
                            "parameters sharded between uses) has per-unit shards to offload",
                            "set parallel.zero: 3 (with dp_sync: allreduce), or memory.offload.params: false")
        if not stored_optim:
            raise SpecError("memory.offload.params", True, "needs the optimizer step on the host: the offloaded "
                            "shards are updated where they are stored",
                            "also set memory.offload.optimizer: true (optim.name adamw or adam), or use "
                            "optim.name paged_adamw")

    def _check_faults(self) -> None:
        ft, world = self.fault_tolerance, self.parallel.world_size
        if ft.collective_timeout_s >= ft.heartbeat_timeout_s:
            raise SpecError(
                "fault_tolerance.collective_timeout_s", ft.collective_timeout_s,
                f"is not below fault_tolerance.heartbeat_timeout_s={ft.heartbeat_timeout_s}: survivors blocked on "
                "a hung rank must give up before the controller declares the hang",
                "set collective_timeout_s below heartbeat_timeout_s",
            )
        if ft.min_dp > self.parallel.dp:
            raise SpecError("fault_tolerance.min_dp", ft.min_dp, f"is above parallel.dp={self.parallel.dp}: the job "
                            "would start below its own floor", f"set min_dp to at most {self.parallel.dp}")
        for i, fault in enumerate(self.faults):
            if fault.rank != "random" and not (isinstance(fault.rank, int) and 0 <= fault.rank < world):
                raise SpecError(f"faults.{i}.rank", fault.rank, f"is not a rank of this {world}-rank job",
                                f"pick a rank from 0 to {world - 1}, or `random` with every_s")
            if fault.at_step is not None and fault.at_step > self.train.steps:
                raise SpecError(f"faults.{i}.at_step", fault.at_step, f"is after the last step {self.train.steps}",
                                f"pick a step from 1 to {self.train.steps}")
            check_repetition(fault, f"faults.{i}")

    def _check_zero(self) -> None:
        """Combinations PyTorch 2.13's own pieces get wrong; refused rather than trained silently wrong."""
        p = self.parallel
        if p.zero == 1 and p.pp > 1 and p.dp > 1:
            raise SpecError(
                "parallel.zero",
                1,
                f"with parallel.pp={p.pp} is not supported: ZeRO-1 wraps stages in DDP, whose reducer breaks "
                "when a pipeline schedule runs one backward per microbatch",
                "use zero: 2 (FSDP2 shards gradients and optimizer state) or zero: 0",
            )
        if p.zero == 3 and p.pp > 1 and p.pp_schedule in _SPLIT_BACKWARD:
            raise SpecError(
                "parallel.zero",
                3,
                f"with pp_schedule {p.pp_schedule!r} gives wrong gradients: its deferred weight-gradient pass "
                "runs after FSDP2 has resharded the parameters (PyTorch issue 164756)",
                "use zero: 2 with this schedule, or pp_schedule: interleaved_1f1b with zero: 3",
            )
        if p.zero == 1 and p.tp > 1 and p.dp > 1:
            raise SpecError(
                "parallel.zero",
                1,
                f"with parallel.tp={p.tp} is not supported: ZeRO-1 uses PyTorch's ZeroRedundancyOptimizer, "
                "which cannot partition tensor-parallel (DTensor) parameters",
                "use zero: 2 (FSDP2 shards gradients and optimizer state, same all-reduce-sized traffic) "
                "or zero: 0, or set parallel.tp: 1",
            )

    def _check_pipeline_split(self) -> None:
        p, n_layers = self.parallel, self.model.n_layers
        spr = p.stages_per_rank
        stages = p.pp * spr
        if n_layers % stages == 0:
            return
        fixes = [f"set model.n_layers to a multiple of {stages} (e.g. {_near_multiples(n_layers, stages)})"]
        pps = [q for q in _divisors(n_layers) if n_layers % (q * spr) == 0]
        if pps:
            fixes.append(f"pick parallel.pp from {pps}")
        if spr > 1:
            fixes.append("use pp_schedule: 1f1b (one stage per rank)")
        raise SpecError(
            "model.n_layers",
            n_layers,
            f"does not split evenly into parallel.pp * stages_per_rank = {p.pp} * {spr} = {stages} pipeline stages",
            ", or ".join(fixes),
        )

    def _check_tensor_split(self) -> None:
        m, p = self.model, self.parallel
        dims = {
            "model.n_heads": m.n_heads,
            "model.d_model": m.d_model,
            "model.d_ff" if m.d_ff is not None else "model.ffn_dim (4*d_model)": m.ffn_dim,
            "model.vocab_size": m.vocab_size,
        }
        if p.sequence_parallel:
            dims["model.seq_len (split by sequence_parallel)"] = m.seq_len
        bad = [f"{k}={v}" for k, v in dims.items() if v % p.tp]
        if not bad:
            return
        valid = [t for t in _divisors(min(dims.values())) if all(v % t == 0 for v in dims.values())]
        fix = f"pick parallel.tp from {valid}, or change the listed model sizes to multiples of {p.tp}"
        if p.sequence_parallel and m.seq_len % p.tp:
            fix += ", or set parallel.sequence_parallel: false"
        raise SpecError("parallel.tp", p.tp, f"does not divide {', '.join(bad)}", fix)

    def _pipeline_problem(self, microbatches: int) -> str | None:
        """Why a pipeline schedule cannot run `microbatches` microbatches, or None if it can."""
        pp, schedule = self.parallel.pp, self.parallel.pp_schedule
        if pp == 1:
            return None
        if schedule in _INTERLEAVED and microbatches % pp:
            return f"is not a multiple of parallel.pp={pp}, which pp_schedule {schedule!r} requires"
        if schedule == "dualpipev" and microbatches < 2 * pp:
            return (
                f"is below the {2 * pp} pipeline stages of pp_schedule 'dualpipev' (two per rank); "
                "it needs microbatches >= 2*pp"
            )
        if microbatches < pp:
            return (
                f"is below parallel.pp={pp}; pp_schedule {schedule!r} needs at least one microbatch "
                "per pipeline rank (microbatches >= pp)"
            )
        return None

    def _check_batching(self) -> None:
        t, dp, pp = self.train, self.parallel.dp, self.parallel.pp
        gbs, mb = t.global_batch_size, t.microbatches
        if gbs % dp:
            dps = [d for d in _divisors(gbs) if (gbs // d) % mb == 0]
            raise SpecError(
                "train.global_batch_size",
                gbs,
                f"is not divisible by parallel.dp={dp}",
                f"use a multiple of dp*microbatches = {dp * mb} (e.g. {_near_multiples(gbs, dp * mb)}), "
                f"or pick parallel.dp from {dps}",
            )
        per_rank = gbs // dp
        valid = [m for m in _divisors(per_rank) if self._pipeline_problem(m) is None]
        if valid:
            fix = f"pick train.microbatches from {valid}"
        else:
            step = dp * pp
            fix = (
                f"raise train.global_batch_size to a multiple of dp*pp = {step} "
                f"(e.g. {_near_multiples(gbs, step)[-1]}) and set train.microbatches: {pp}"
            )
        if per_rank % mb:
            raise SpecError(
                "train.microbatches",
                mb,
                f"does not divide the per-data-rank batch global_batch_size/dp = {gbs}/{dp} = {per_rank}",
                fix,
            )
        problem = self._pipeline_problem(mb)
        if problem:
            raise SpecError("train.microbatches", mb, problem, fix)


# ---------------------------------------------------------------- pydantic -> SpecError

_EXPECTED = {
    "int_type": "a whole number",
    "int_parsing": "a whole number",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string (quote it if YAML reads it as a number or boolean)",
    "string_too_short": "a non-empty string",
    "string_pattern_mismatch": "a name of letters, digits, '.', '_' or '-' (it becomes a directory name)",
    "model_type": "a section: indented `key: value` lines under it",
    "tuple_type": "a list",
    "too_short": "a list with the right number of items",
    "too_long": "a list with the right number of items",
}

_BOUNDS = {
    "greater_than": (">", "gt"),
    "greater_than_equal": (">=", "ge"),
    "less_than": ("<", "lt"),
    "less_than_equal": ("<=", "le"),
}


def _keys_of(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """Accepted keys of a section: YAML aliases first, then python names."""
    keys = {info.alias or name: info for name, info in model.model_fields.items()}
    keys.update({name: info for name, info in model.model_fields.items() if name not in keys})
    return keys


def _yaml_keys(model: type[BaseModel]) -> list[str]:
    return [info.alias or name for name, info in model.model_fields.items()]


def _section_model(info: FieldInfo) -> type[BaseModel] | None:
    """The model of a section field, or of the items of a list-of-sections field (`faults`)."""
    ann = info.annotation
    if typing.get_origin(ann) in (typing.Union, types.UnionType):  # an optional section such as model.lora
        ann = next(a for a in typing.get_args(ann) if a is not type(None))
    if typing.get_origin(ann) is list:
        ann = typing.get_args(ann)[0]
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The section model reached by following `loc` from `JobSpec` (None past a leaf; list indices pass through)."""
    model: type[BaseModel] | None = JobSpec
    for part in loc:
        if isinstance(part, int):
            continue
        info = _keys_of(model).get(part) if model is not None else None
        model = _section_model(info) if info is not None else None
    return model


def _field_at(loc: tuple[Any, ...]) -> FieldInfo | None:
    """FieldInfo of the field at `loc`; trailing tuple indices (optim.betas[0]) map to the tuple field."""
    keys = tuple(itertools.takewhile(lambda part: isinstance(part, str), loc))
    model = _model_at(keys[:-1]) if keys else None
    return _keys_of(model).get(keys[-1]) if model is not None else None


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _unknown_field(loc: tuple[Any, ...]) -> SpecError:
    parent_loc, key = loc[:-1], str(loc[-1])
    parent = _model_at(parent_loc)
    valid = _yaml_keys(parent) if parent is not None else []
    close = difflib.get_close_matches(key, valid, n=1)
    if close:
        hint = f"did you mean `{close[0]}`? "
    else:
        homes = [s for s in _SECTIONS if key in _keys_of(_model_at((s,)))]
        hint = f"did you mean `{homes[0]}.{key}` (put it under `{homes[0]}:`)? " if homes else "remove or rename it; "
    if parent_loc:
        return SpecError(".".join(map(str, loc)), NO_VALUE, "unknown field", f"{hint}valid fields: {', '.join(valid)}")
    return SpecError(key, NO_VALUE, "unknown top-level section", f"{hint}valid top-level keys: {', '.join(valid)}")


def _to_spec_error(exc: ValidationError) -> SpecError:
    """Turn the most useful pydantic error into a SpecError; count the rest."""
    errors = sorted(exc.errors(), key=lambda e: e["type"] not in ("extra_forbidden", "invalid_key"))
    first, more = errors[0], len(errors) - 1
    ctx = first.get("ctx") or {}
    if isinstance(ctx.get("error"), SpecError):
        return ctx["error"].with_more(more)
    loc, kind = tuple(first["loc"]), first["type"]
    field = _dotted(loc)
    if kind in ("extra_forbidden", "invalid_key"):
        return _unknown_field(loc).with_more(more)
    info = _field_at(loc)
    if kind == "missing" and isinstance(loc[-1], int):  # short list for a fixed-size tuple such as optim.betas
        field = _dotted(loc[:-1])
        fix = f"set `{field}` to a list{_default_hint(info)}"
        return SpecError(field, NO_VALUE, "has too few items", fix, more=more)
    if kind == "missing":
        if field == "data":
            fix = (
                "add a `data:` section with `path: <dir>`, "
                "the directory written by `raymesh prepare-data --out <dir>`"
            )
        elif field == "data.path":
            fix = "add `path: <dir>` under `data:`, the directory written by `raymesh prepare-data --out <dir>`"
        else:
            fix = f"add `{field}` to the job file"
        return SpecError(field, NO_VALUE, "is required but missing", fix, more=more)
    if kind == "literal_error" and info is not None and get_origin(info.annotation) is Literal:
        choices = get_args(info.annotation)
        expected = f"one of {', '.join(map(str, choices))}"
        close = difflib.get_close_matches(str(first["input"]), [str(c) for c in choices], n=1)
        if close:
            expected += f" (did you mean {close[0]}?)"
    elif kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        expected = f"a number {op} {ctx[key]}"
    else:
        expected = _EXPECTED.get(kind) or first["msg"].removeprefix("Input should be ")
    msg = first["msg"]
    problem = "is not a section" if kind == "model_type" else f"is not valid ({msg[0].lower()}{msg[1:]})"
    return SpecError(field, first.get("input"), problem, f"set `{field}` to {expected}{_default_hint(info)}", more=more)


def _default_hint(info: FieldInfo | None) -> str:
    if info is None or info.default is PydanticUndefined or info.default is None:
        return ""
    return f"; the default is {json.dumps(info.default)}"


# ---------------------------------------------------------------- loading and overrides


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """Split `key.path=value` into (path parts, value).

    The value is read as YAML so `4`, `0.1`, `true` and `[1, 2]` keep their types;
    an empty value is null, which resets an optional field to its default.
    """
    key, sep, raw = text.partition("=")
    if not sep:
        raise SpecError(
            None,
            text,
            "has no `=`",
            "write overrides as `key.path=value`, e.g. `parallel.dp=4` or `optim.betas=[0.9,0.99]`",
            where="override",
        )
    parts = tuple(p.strip() for p in key.split("."))
    if not all(parts):
        raise SpecError(
            None,
            text,
            "has an empty key segment before `=`",
            "name the field as dotted keys, e.g. `train.steps=10`",
            where="override",
        )
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        raise SpecError(
            ".".join(parts), raw, "is not a valid YAML value", "quote the value, e.g. `name='my job'`", where="override"
        ) from None
    return parts, value


def apply_overrides(raw: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a deep copy of a raw job dict with overrides applied, creating sections as needed."""
    out = copy.deepcopy(dict(raw))
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                raise SpecError(
                    prefix,
                    child,
                    f"is not a section, so override `{text}` cannot set a field inside it",
                    f"override `{prefix}` itself, e.g. `{prefix}=<value>`",
                )
            node = child
        node[parts[-1]] = value
    return out


def _resolve_paths(raw: dict[str, Any], cwd: Path) -> None:
    """Make relative path fields absolute against `cwd`, in place (see module docstring)."""
    for section, key in ((None, "run_dir"), ("data", "path"), ("checkpoint", "dir"), ("metrics", "file_sd"),
                         ("memory.offload", "path"), ("model.lora", "base_checkpoint")):
        holder = raw
        for name in section.split(".") if section else ():
            holder = holder.get(name) if isinstance(holder, dict) else None
        if isinstance(holder, dict) and isinstance(holder.get(key), str) and holder[key]:
            holder[key] = str(cwd / Path(holder[key]).expanduser())


def load_spec(path: str | Path, overrides: Iterable[str] = ()) -> JobSpec:
    """Read a YAML job file, apply `key.path=value` overrides and validate.

    Relative `data.path`, `run_dir` and `checkpoint.dir` become absolute against
    the current working directory.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise SpecError(
            None,
            str(path),
            f"does not exist (looked for {p.absolute()})",
            f"check the path; relative paths are taken from the current directory {os.getcwd()}",
        ) from None
    except OSError as exc:
        problem = f"cannot be read ({exc.strerror})"
        raise SpecError(None, str(path), problem, "pass the path of a readable YAML file") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(exc, "problem", None) or str(exc)
        line_fix = f" near line {mark.line + 1}" if mark else ""
        raise SpecError(
            None,
            str(path),
            f"is not valid YAML{where}: {reason}",
            f"correct the YAML{line_fix}: check indentation, and that each `key: value` has a space after the colon",
        ) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(
            None,
            str(path),
            f"holds a YAML {type(raw).__name__}, not a mapping of sections",
            "write the job as `section:` blocks, e.g. `data:` then `  path: data/tiny` on the next line",
        )
    raw = apply_overrides(raw, overrides)
    _resolve_paths(raw, Path.cwd())
    return JobSpec.from_dict(raw)


# ---------------------------------------------------------------- runtime checks


def check_data_path(spec: JobSpec) -> None:
    """Fail early when `data.path` has not been prepared; kept out of validation because data may live elsewhere."""
    manifest = Path(spec.data.path) / "manifest.json"
    if not manifest.is_file():
        raise SpecError(
            "data.path",
            spec.data.path,
            f"has no prepared data ({manifest} is missing)",
            f"run `raymesh prepare-data --out {spec.data.path}`, or point data.path at a prepared directory",
        )


def check_resources(spec: JobSpec, available_cpus: float, available_gpus: float, device: str) -> None:
    """Check the cluster can host dp*pp*tp ranks before any actor is created.

    Each rank takes `parallel.cpus_per_rank` CPUs, plus one GPU when `device` is
    "cuda" ("auto" means cuda when any GPU is available).
    """
    p = spec.parallel
    ranks = p.world_size
    shape = f"dp*pp*tp = {p.dp}*{p.pp}*{p.tp} = {ranks} ranks"
    use_gpu = device == "cuda" or (device == "auto" and available_gpus >= 1)
    if use_gpu and ranks > available_gpus:
        raise SpecError(
            "parallel.dp*pp*tp",
            ranks,
            f"needs {ranks} GPUs (one per rank, {shape}) but Ray has {available_gpus:g} available",
            f"lower parallel.dp/pp/tp so dp*pp*tp <= {int(available_gpus)}, add GPU nodes to the Ray cluster, "
            "or set parallel.device: cpu",
        )
    needed = ranks * p.cpus_per_rank
    if needed > available_cpus + 1e-9:
        fit = int(available_cpus // p.cpus_per_rank)
        fixes = [f"lower parallel.dp/pp/tp so dp*pp*tp <= {fit}"] if fit >= 1 else []
        fixes += [
            f"lower parallel.cpus_per_rank to {available_cpus / ranks:g}",
            "start Ray with more CPUs (`ray start --head --num-cpus N`) or add nodes",
        ]
        raise SpecError(
            "parallel.dp*pp*tp",
            ranks,
            f"needs {needed:g} CPUs ({shape} x parallel.cpus_per_rank={p.cpus_per_rank:g}) "
            f"but Ray has {available_cpus:g} available",
            ", or ".join(fixes),
        )
