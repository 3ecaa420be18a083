"""The job file's sections other than `model`: the driver's side of each, with the checks that need only that
section.

A section the ranks read is declared in ``workers.contract.sections`` (its fields, bounds and defaults); the class
here subclasses it to add the validators that raise a ``SpecError`` naming the field and the fix, and what only
the controller uses. The sections only the controller reads (checkpoint, plan, faults, control) are declared here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from orchestrator.errors import SpecError
from orchestrator.spec.fields import (
    MAX_SLOWDOWN,
    STRICT,
    TIMEOUT_MAX,
    Host,
    PathStr,
    Seconds,
    Seed,
    _divisors,
    _Section,
)
from orchestrator.units import parse_bytes
from workers.contract.compression_kinds import WITH_FEEDBACK
from workers.contract.sections import (
    DataSection,
    EvalSection,
    FaultToleranceSection,
    MemorySection,
    MetricsSection,
    OffloadSection,
    OptimSection,
    ParallelSection,
    ParameterServerSection,
    PrecisionSection,
    TrainSection,
)
from workers.storage import location


def tls_pair(section: str, spec):
    """``spec`` (a section with ``tls_cert`` and ``tls_key``: control, parameter_server) when it names both PEM
    files or neither: a certificate cannot be served without its key, nor a key without its certificate."""
    if (spec.tls_cert is None) != (spec.tls_key is None):
        given, missing = ("tls_cert", "tls_key") if spec.tls_key is None else ("tls_key", "tls_cert")
        raise SpecError(f"{section}.{missing}", None, f"is required when {section}.{given} is set",
                        f"set {section}.{missing} to the matching PEM file, or remove {section}.{given}")
    return spec


class DataSpec(DataSection):
    """`data:` (fields in ``DataSection``): one directory or a mixture, each directory listed once."""

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        """`path` or `mix`, not both (which one would the job train on?) and not neither."""
        if self.path is not None and self.mix is not None:
            raise SpecError("data.path", self.path, "is set together with data.mix, and a job trains on one or the "
                            "other", "remove data.path and list that directory as a data.mix entry (`- {path: DIR, "
                            "weight: W}`), or remove data.mix")
        if self.path is None and self.mix is None:
            raise SpecError("data.path", None, "is required but missing", "add `path: <dir>` under `data:`, the "
                            "directory written by `raymesh prepare-data --out <dir>` (or `mix:`, a list of "
                            "`{path: DIR, weight: W}` entries, to blend several)")
        paths = [entry.path.rstrip("/") or entry.path for entry in self.mix or ()]  # `s3://b/x/` is `s3://b/x`
        repeated = next((self.mix[i].path for i, p in enumerate(paths) if p in paths[:i]), None)
        if repeated is not None:
            raise SpecError("data.mix", repeated, "is listed twice", "list each directory once, with the sum of "
                            "the two weights")
        return self

    def field_of(self, path: str) -> str:
        """The job-file field naming the training directory `path` (`data.path`, `data.mix[i].path`)."""
        if not self.mix:
            return "data.path"
        return f"data.mix[{[entry.path for entry in self.mix].index(path)}].path"


class ParallelSpec(ParallelSection):
    """`parallel:` (fields and the grid in ``ParallelSection``): the device memory size and the degrees checked."""

    @property
    def device_memory_bytes(self) -> int | None:
        return None if self.device_memory is None else parse_bytes(self.device_memory)

    @model_validator(mode="after")
    def _check_device_memory(self) -> ParallelSpec:
        """A size in bytes above zero: 0 or a negative count would make every layout "not fit" in `plan`."""
        if self.device_memory is None:
            return self
        try:
            size = parse_bytes(self.device_memory)
        except ValueError:
            size = None
        if size is None or size <= 0:
            raise SpecError("parallel.device_memory", self.device_memory, "is not a size" if size is None else
                            "is not a positive size", "write bytes with a unit, e.g. 80GB (decimal), 80GiB (binary) "
                            "or 85899345920, or remove it for the GPU's own (plan.gpu)")
        return self

    @model_validator(mode="after")
    def _check_ep(self) -> ParallelSpec:
        if (self.dp * self.cp) % self.ep:
            raise SpecError("parallel.ep", self.ep, f"does not divide parallel.dp * parallel.cp = {self.dp * self.cp}: "
                            "expert groups are carved out of the data x context-parallel ranks",
                            f"pick ep from the divisors of dp*cp: {', '.join(map(str, _divisors(self.dp * self.cp)))}")
        return self

    @model_validator(mode="after")
    def _check_dp_shard(self) -> ParallelSpec:
        """Hybrid sharding splits dp evenly, and only ZeRO 1-3 over all-reduce have a state to shard."""
        shard = self.dp_shard
        if shard is None:
            return self
        if self.dp % shard:
            raise SpecError("parallel.dp_shard", shard, f"does not divide parallel.dp={self.dp}: shard groups "
                            "split the data-parallel ranks evenly",
                            f"pick dp_shard from the divisors of dp: {', '.join(map(str, _divisors(self.dp)))}")
        if shard < self.dp and (self.zero == 0 or self.dp_sync != "allreduce"):
            why = "zero 0 shards nothing" if self.zero == 0 else "parameter-server shards hold the state"
            raise SpecError("parallel.dp_shard", shard, f"needs parallel.zero 1, 2 or 3 with dp_sync allreduce "
                            f"({why})", "set parallel.zero: 1, 2 or 3, or remove dp_shard")
        if shard < self.dp and self.ep > 1:
            raise SpecError("parallel.dp_shard", shard, f"is not supported with expert parallelism (ep={self.ep}) "
                            "yet: experts shard over their own edp groups", "remove dp_shard, or set ep: 1")
        return self

    @model_validator(mode="after")
    def _check_virtual_stages(self) -> ParallelSpec:
        v, schedule, facts = self.virtual_stages, self.pp_schedule, self.pipeline_schedule
        if v is None:
            return self
        if facts.single_stage and v != 1:
            raise SpecError(
                "parallel.virtual_stages",
                v,
                f"is not supported by pp_schedule {schedule!r}, which runs one stage per pp rank",
                "remove virtual_stages, or use pp_schedule: interleaved_1f1b for several stages per rank",
            )
        if facts.interleaved and v < 2:
            raise SpecError(
                "parallel.virtual_stages",
                v,
                f"is too small: pp_schedule {schedule!r} needs at least 2 stages per pp rank",
                "set virtual_stages to 2 or more (or remove it; the default is 2), or use pp_schedule: 1f1b",
            )
        if facts.v_shape and v != 2:
            raise SpecError(
                "parallel.virtual_stages",
                v,
                f"is not allowed: pp_schedule {schedule!r} runs exactly 2 stages per pp rank (V shape)",
                "set virtual_stages: 2, or remove it",
            )
        return self


class OptimSpec(OptimSection):
    """`optim:` (fields in ``OptimSection``): one length for wsd's decay."""

    @model_validator(mode="after")
    def _one_decay_length(self) -> OptimSpec:
        """``decay_steps`` and ``decay_ratio`` both size wsd's decay: with both, one would be ignored. A ratio other
        than its default counts as set (a value, not ``model_fields_set``, as ``fields.changed``: a spec
        round-trips through ``to_dict``, which writes every field, on its way to the hosted controller)."""
        if self.decay_steps is not None and self.decay_ratio != type(self).model_fields["decay_ratio"].default:
            raise SpecError("optim.decay_ratio", self.decay_ratio, f"and optim.decay_steps {self.decay_steps} both "
                            "set the length of wsd's decay", "keep one of them (decay_steps counts steps, "
                            "decay_ratio is a share of train.steps; `--set optim.decay_ratio=0.1`, its default, "
                            "leaves decay_steps alone)")
        return self


PrecisionSpec = PrecisionSection  # `precision:`: no check of its own (how it combines: checks/precision.py)
OffloadSpec = OffloadSection  # `memory.offload:` (checks/memory.py)
MemorySpec = MemorySection  # `memory:` (checks/memory.py)


def recompute_plan(policy: str, every: int, n_layers: int) -> tuple[str, int]:
    """The policy and interval the workers run for ``memory.recompute``/``recompute_every`` on ``n_layers`` blocks.

    ``sqrt`` is Chen et al. 2016's segment checkpointing: segments of k = round(√n) consecutive blocks, each
    storing only its input and recomputed whole in backward (``workers.parallel.recompute.checkpoint_segment``);
    the interval sent is the segment length k.
    """
    if policy == "sqrt":
        return "sqrt", max(1, round(math.sqrt(n_layers)))
    return policy, every


class PlanSpec(_Section):
    """What `raymesh plan --nodes N` prices layouts with: the GPU type's defaults (orchestrator/planning/
    time_model.py GPUS), overridable; bandwidths in GB/s per GPU and direction."""

    gpu: Literal["A100", "H100", "H200", "H800"] = "H100"
    efficiency: Annotated[float, Field(gt=0.0, le=1.0)] = 0.5  # share of peak FLOP/s the model reaches
    intra_node_gbps: Annotated[float, Field(gt=0, le=1_000_000)] | None = None  # NVLink; default per GPU type
    # InfiniBand share per GPU; default per GPU type
    inter_node_gbps: Annotated[float, Field(gt=0, le=1_000_000)] | None = None


class TrainSpec(TrainSection):
    """`train:` (fields in ``TrainSection``): the job file offers the built-in objectives only."""

    # lm: next-token cross entropy; dpo: Direct Preference Optimization (spec/checks/dpo.py). A rank takes any
    # objective registered in workers/step/objectives.py; the job file the two built in
    objective: Literal["lm", "dpo"] = TrainSection.model_fields["objective"].default


EvalSpec = EvalSection  # `eval:` (checks/eval.py)


def dp_replicas_mirror(parallel: ParallelSpec, optim: OptimSpec) -> bool:
    """Whether every data-parallel replica holds the whole state bit for bit (zero 0, all-reduce, dp > 1): a
    replica's own snapshot then is its peers' replica, so a snapshot costs one local copy and ships nothing.
    With expert parallelism only the ranks holding the same experts mirror (``Grid.expert_stride`` dp indices
    apart), so there must be two.

    Not where each rank also keeps state of its own (``dp_ranks_keep_their_own``): a peer's snapshot would hand
    a replaced rank the peer's, and the run would leave the uninterrupted one's path or stop."""
    grid = parallel.grid
    return (parallel.zero == 0 and grid.dp > grid.expert_stride and parallel.dp_sync == "allreduce"
            and not dp_ranks_keep_their_own(parallel, optim))


def ps_replicas_mirror(parallel: ParallelSpec, ps: ParameterServerSpec) -> bool:
    """BSP parameter-server ranks mirror each other too: each pulls the same weights after every step (their
    optimizer state is on the shards, which keep their own beside the snapshot: ``PSShards.keep``), unless top-k
    compresses their pushes: each rank's error feedback is its own."""
    return parallel.dp_sync == "ps" and ps.consistency == "bsp" and ps.compression != "topk" and parallel.grid.dp > 1


def dp_ranks_keep_their_own(parallel: ParallelSpec, optim: OptimSpec) -> bool:
    """Whether data-parallel ranks with the same weights still differ: in what PowerSGD, top-k or 1-bit Adam
    held back from the wire (their error feedback), or in an asynchronous pipeline's microbatches in flight
    and gradient accumulated so far (each rank's own data)."""
    feedback = parallel.grad_compression in WITH_FEEDBACK or optim.name == "onebit_adam"
    return feedback or parallel.pipeline_schedule.asynchronous


class CheckpointSpec(_Section):
    """Checkpoint cadence; `every: 0` never checkpoints. YAML key `async` maps to `async_save`.

    On by default (every 50 steps, asynchronous, and at the last step): a lost driver, head node, or a
    rank lost together with its replica holder otherwise loses the whole run.
    """

    model_config = ConfigDict(STRICT, populate_by_name=True)

    every: Annotated[int, Field(ge=0)] = 50
    dir: PathStr | None = None
    async_save: bool = Field(default=True, alias="async")
    keep: Annotated[int, Field(ge=1)] = 3
    keep_best: bool = False  # also keep the checkpoint with the lowest held-out loss (eval.every), whatever its age
    # in-memory snapshot (+ replica on a peer) cadence; 0: off; unset: every step where the data-parallel
    # replicas mirror each other (the snapshot ships nothing), else every 10 steps
    memory_every: Annotated[int, Field(ge=0)] | None = None
    # who may read the checkpoints (and the run dir raymesh makes): private (dirs 0700, files 0600), group (0750,
    # 0640), or umask (as the process's umask leaves them); local and shared file systems (a bucket has its policy)
    permissions: Literal["private", "group", "umask"] = "private"

    def snapshot_every(self, parallel: ParallelSpec, optim: OptimSpec) -> int:
        """``memory_every``, or its default for this layout."""
        if self.memory_every is not None:
            return self.memory_every
        return 1 if dp_replicas_mirror(parallel, optim) else 10

    def resolved_dir(self, run_dir: str | Path) -> Path:
        """`dir` when set (a local path or an object-store URL: `workers.storage`), else
        `<run_dir>/checkpoints`."""
        return location(self.dir) if self.dir is not None else location(run_dir) / "checkpoints"


class FaultToleranceSpec(FaultToleranceSection):
    """How failures are detected and how many restarts a job may spend (the ranks' own field in
    ``FaultToleranceSection``)."""

    # the progress deadline of a window's first step, a save, an evaluating step (others: hang_steps typical steps,
    # at least hang_floor_s, at most this); a rank stuck past it hung
    heartbeat_timeout_s: Seconds = 120.0
    # the progress deadline of a typical step: this many times the median of the last twenty steps, at least
    # hang_floor_s (a frozen rank is found within seconds; every rank's stacks go to <run_dir>/hangs/)
    hang_steps: Annotated[float, Field(gt=1)] = 3.0
    hang_floor_s: Seconds = 5.0
    # after a rank failed, survivors still blocked in the failed step this long (or 2 steps, if longer) are
    # restarted with it and restored from their replicas, instead of waiting out collective_timeout_s
    survivor_grace_s: Seconds = 2.0
    # a step whose loss is not finite is rolled back and run again (each counts against max_restarts); after
    # nan_retries re-runs that are NaN again at the same step: skip_batch (that step's batch is skipped, and
    # the event log says so) or stop (the run fails with the step and the fix)
    nan_retries: Annotated[int, Field(ge=0)] = 1
    on_repeated_nan: Literal["skip_batch", "stop"] = "skip_batch"
    # a rate, not a lifetime budget: more than max_restarts rank restarts within any restart_window_s seconds
    # ends the job (a crash loop stops within minutes; a long run that loses a rank a minute goes on)
    max_restarts: Annotated[int, Field(ge=0)] = 20
    restart_window_s: Seconds = 600.0
    # replace_failed: new actors for the failed ranks only, state from memory (else disk); restart_all: every
    # rank torn down and restarted from the last disk checkpoint, as Ray Train and torchrun do (a baseline);
    # keep_training: the other data-parallel replicas go on stepping while the failed one is rebuilt
    # (orchestrator/recovery/keep_training.py; plain data parallelism only: checks/recovery.py)
    recovery: Literal["replace_failed", "restart_all", "keep_training"] = "replace_failed"
    # CPU jobs: one rank process per node started after the first step with torch imported, which a replacement
    # takes over (seconds off every recovery); false saves its memory (~0.5 GB a node) and its start-up CPU
    warm_spares: bool = True
    straggler_ratio: Annotated[float, Field(gt=1)] = 1 / 0.7  # step time over the other ranks' median
    straggler_steps: Annotated[int, Field(ge=1)] = 3  # consecutive steps above the ratio before it is reported
    # elastic data parallelism: a replacement not started by then (its node is gone) shrinks dp instead
    placement_timeout_s: Seconds = 60.0
    min_dp: Annotated[int, Field(ge=1)] = 1  # never shrink below this many data-parallel replicas
    grow_check_s: Seconds = 30.0  # below the requested dp, look for room this often


class ParameterServerSpec(ParameterServerSection):
    """`parameter_server:` (fields in ``ParameterServerSection``): certificate and key named together."""

    @model_validator(mode="after")
    def _tls_pair(self) -> ParameterServerSpec:
        return tls_pair("parameter_server", self)

    def shards_at(self, step: int) -> int:
        """The shard count step ``step`` runs on (``resize``)."""
        return next((r.shards for r in reversed(self.resize) if r.at_step <= step), self.shards)

    def server_optim(self, optim: OptimSpec) -> dict:
        """What each shard's optimizer is built from."""
        return {"name": self.optimizer or optim.name, "lr": optim.lr, "weight_decay": optim.weight_decay,
                "weight_decay_exclude": optim.weight_decay_exclude, "betas": list(optim.betas),
                "momentum": optim.momentum}


class FaultSpec(_Section):
    """One injected fault (the fault-injection harness): deterministic by step and rank (or shard)."""

    kind: Literal["kill_rank", "kill_node", "hang_rank", "slow_rank", "nan_loss", "corrupt_checkpoint",
                  "kill_ps_shard", "raise_error", "oom"]
    rank: int | str = 0  # or `random`: drawn by seed (repeating faults only); checked by JobSpec._check_faults
    shard: Annotated[int, Field(ge=0)] = 0  # kill_ps_shard: which parameter-server shard dies
    at_step: Annotated[int, Field(ge=1)] | None = None  # a one-shot fault's step
    # slow_rank: its steps take this many times as long (past MAX_SLOWDOWN the rank is hung: that is hang_rank)
    factor: Annotated[float, Field(gt=1, le=MAX_SLOWDOWN)] = 3.0
    every_s: Seconds | None = None  # instead of at_step: fire again every this many seconds
    # the n-th firing is due n * every_s after the first step, plus uniform(-jitter_s, jitter_s) (not cumulative)
    jitter_s: Annotated[float, Field(ge=0, le=TIMEOUT_MAX)] = 0.0
    seed: Seed = 0  # draws the gaps and random ranks of a repeating fault


class MetricsSpec(MetricsSection):
    """The controller's Prometheus endpoint and what the run records for reports (what the ranks record:
    ``MetricsSection``)."""

    port: Annotated[int, Field(ge=0, le=65535)] | None = None  # None: no endpoint; 0: any free port
    host: Host = "127.0.0.1"  # interface the endpoint binds; 0.0.0.0 (or the node's IP) lets a remote Prometheus in
    # Prometheus file_sd target file; default runs/prometheus_targets/<run_dir name>.json
    file_sd: PathStr | None = None
    peak_tflops_per_rank: Annotated[float, Field(gt=0)] | None = None  # for MFU; default by device

    def resolved_file_sd(self, run_dir: str | Path) -> Path:
        """One shared folder beside the run dirs: Prometheus globs only a path's last element."""
        if self.file_sd is not None:
            return Path(self.file_sd)
        return Path(run_dir).parent / "prometheus_targets" / f"{Path(run_dir).name}.json"


class ControlSpec(_Section):
    """The job's control API (`raymesh status/stop/inject/scale`): where it listens and what it allows.

    Every call needs the job's token either way (see orchestrator/api/auth.py).
    """

    host: Host = "127.0.0.1"  # loopback only; 0.0.0.0 or the node's IP lets other machines in (add TLS then)
    port: Annotated[int, Field(ge=0, le=65535)] = 0  # 0: any free port
    tls_cert: str | None = None  # PEM certificate chain; with tls_key, the API speaks TLS only
    tls_key: str | None = None  # PEM private key of tls_cert
    allow_faults: bool | None = None  # live `raymesh inject`; None: allowed only when the job file has `faults:`

    @model_validator(mode="after")
    def _tls_pair(self) -> ControlSpec:
        return tls_pair("control", self)
