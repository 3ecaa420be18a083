"""The job spec as the workers read it: frozen sections parsed once from the plain dict the controller sends.

Workers never import the orchestrator (its pydantic ``JobSpec`` validates the job); they receive
``JobSpec.worker_dict()``, already validated and with derived values filled in, and turn it into these
records in one place (``WorkerSpec.from_dict``), so the trainer reads attributes, not string subscripts.
Builders that take a section as a plain dict (optimizer, offload stores) get it from
``raw``, the dict as sent.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any

from workers.model.config import ModelConfig, model_config
from workers.model.registry import ModelFamily, family
from workers.parallel.grid import Grid
from workers.parallel.mixed_precision import uses_fsdp_mixed


def _section(cls, raw: dict, name: str):
    """``cls`` from the keys of ``raw[name]`` it declares (the dict carries more than a worker reads)."""
    values = raw.get(name, {})
    missing = [f.name for f in fields(cls) if f.name not in values and f.default is MISSING]
    if missing:
        raise KeyError(f"worker spec field {name}.{missing[0]} is missing; send the dict JobSpec.worker_dict() "
                       "builds (it fills in every field)")
    return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


@dataclass(frozen=True)
class ParallelSection:
    dp: int
    pp: int
    tp: int
    device: str
    zero: int
    pp_schedule: str
    dp_sync: str
    virtual_stages: int  # model chunks per pp rank (JobSpec.worker_dict fills in the schedule's default)
    sequence_parallel: bool
    cp: int = 1  # older harness dicts leave the cp fields out
    cp_impl: str = "ring"
    # ZeRO-0 gradient buckets (workers.parallel.grad_buckets); older harness dicts leave these out
    bucket_mb: float = 25.0
    grad_compression: str = "none"
    powersgd_rank: int = 4
    powersgd_warmup_steps: int = 10
    topk_ratio: float = 0.01
    ep: int = 1  # expert parallelism (older harness dicts leave it out)
    # PipeDream's asynchronous schedules (workers.parallel.async_pipeline); older harness dicts leave these out
    pp_vertical_sync: bool = False
    pp_2bw_every: int | None = None  # 2BW: microbatches per weight version (None: train.microbatches)
    pp_flush_per_step: bool = False  # drain at every step end (default: the steady state carries over)
    # layers per pipeline stage (parallel.pp_split resolved by JobSpec.worker_dict); None: an even split
    pp_split: tuple[int, ...] | None = None
    fsdp_prefetch: int = 0  # FSDP2 blocks gathered ahead (workers.parallel.fsdp_prefetch); 0: FSDP2's own order

    def __post_init__(self) -> None:
        if self.pp_split is not None:  # a list in the dict as sent; frozen, so set through object
            object.__setattr__(self, "pp_split", tuple(self.pp_split))

    @property
    def grid(self) -> Grid:
        """This job's rank grid: every degree, coordinate and mesh fact comes from here."""
        return Grid.from_parallel(self)


@dataclass(frozen=True)
class TrainSection:
    steps: int
    global_batch_size: int
    microbatches: int
    seed: int
    compile: bool = False  # each block through torch.compile (workers.parallel.compile); older dicts leave it out
    loss_chunks: int = 1  # the head and loss per chunk of tokens (workers.model.gpt.chunked_lm_loss); 1: whole
    objective: str = "lm"  # or dpo (workers.model.dpo); older harness dicts leave these out
    dpo_beta: float = 0.1


@dataclass(frozen=True)
class EvalSection:
    """The held-out loss (``workers.evaluation``); older harness dicts leave the section out: never."""

    every: int = 0
    path: str | None = None
    batches: int = 4

    def due(self, step: int, last: int) -> bool:
        """Whether the model is scored after optimizer step ``step`` (1-based) of a run ending at step ``last``:
        after every ``every``-th step and after the last."""
        return self.every > 0 and (step % self.every == 0 or step == last)


@dataclass(frozen=True)
class DataSection:
    path: str | None
    seed: int
    mix: list[dict] | None = None  # data.mix: [{path, weight}, ...] (older harness dicts leave it out)

    def sources(self) -> list[tuple[str, float]] | None:
        """The mixture's (path, weight) pairs, None for one directory (`workers.data.loader.open_data`)."""
        return [(entry["path"], entry["weight"]) for entry in self.mix] if self.mix else None


@dataclass(frozen=True)
class PrecisionSection:
    dtype: str
    initial_loss_scale: float
    policy: str = "auto"  # older harness dicts leave these out (workers.parallel.mixed_precision)
    reduce_dtype: str = "fp32"


@dataclass(frozen=True)
class MemorySection:
    recompute: str
    offload: dict  # the offload stores read it as a dict
    measure: bool = False  # older harness dicts leave it out
    recompute_every: int = 1

    @property
    def offloads_params(self) -> bool:
        return bool(self.offload.get("params"))


@dataclass(frozen=True)
class ParameterServerSection:
    transport: str
    consistency: str
    chunk_elems: int
    virtual_nodes: int
    compression: str = "none"  # what pushes and pulls carry (parameter_server/compression.py)
    topk_ratio: float = 0.01


@dataclass(frozen=True)
class WorkerSpec:
    """The sections a rank reads, plus ``raw`` (the dict as sent) for dict-taking builders."""

    parallel: ParallelSection
    train: TrainSection
    data: DataSection
    eval: EvalSection
    precision: PrecisionSection
    memory: MemorySection
    model: ModelConfig
    lora: dict[str, Any] | None  # model.lora as sent (the LoRA builders read it as a dict)
    init_from: str | None  # model.init_from: a Hugging Face directory the builder reads the weights from
    grad_clip: float
    collective_timeout_s: float
    record_timeline: bool
    count_comm_bytes: bool  # metrics.comm_bytes: the step's collectives are counted (workers.diagnostics.comm_bytes)
    raw: dict[str, Any]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> WorkerSpec:
        return cls(
            parallel=_section(ParallelSection, raw, "parallel"),
            train=_section(TrainSection, raw, "train"),
            data=_section(DataSection, raw, "data"),
            eval=_section(EvalSection, raw, "eval"),
            precision=_section(PrecisionSection, raw, "precision"),
            memory=_section(MemorySection, raw, "memory"),
            model=model_config(raw["model"]),
            lora=raw["model"].get("lora"),
            init_from=raw["model"].get("init_from"),
            grad_clip=raw["optim"]["grad_clip"],
            collective_timeout_s=raw["fault_tolerance"]["collective_timeout_s"],
            record_timeline=raw["metrics"]["timeline"],
            count_comm_bytes=raw["metrics"].get("comm_bytes", False),
            raw=raw,
        )

    @property
    def model_family(self) -> ModelFamily:
        """The registered family of ``model.arch``: the builder's hooks and recompute targets come from it."""
        return family(self.model.arch)

    @property
    def parameter_server(self) -> ParameterServerSection:
        """Read only on the PS path (``parallel.dp_sync: ps``)."""
        return _section(ParameterServerSection, self.raw, "parameter_server")

    def fsdp_mixed(self, on_cuda: bool) -> bool:
        """Whether bf16 runs through FSDP2's mixed-precision policy here (``workers.parallel.mixed_precision``)."""
        p = self.parallel
        return uses_fsdp_mixed(self.precision.dtype, self.precision.policy, p.zero, p.dp_sync, on_cuda)
