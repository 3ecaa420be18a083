"""The job-file sections a rank reads, declared once: fields, types, bounds and defaults (torch-free).

The controller's ``orchestrator.spec`` subclasses each (``ParallelSpec(ParallelSection)``, ...) to add the checks
that raise a ``SpecError`` naming the field and the fix; a rank parses the dict the controller sends
(``JobSpec.worker_dict()``) with these same classes (``workers.spec.WorkerSpec``). A default changed here is the
job file's and the rank's at once. ``metrics`` and ``fault_tolerance`` are mostly the controller's: their
classes here hold the fields a rank reads, and the driver's subclasses add the rest.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from workers.contract.compression_kinds import KINDS, PS_KINDS
from workers.contract.fields import Betas, PathStr, PipelineSchedule, PositiveFloat, PositiveInt, Seconds, Section, Seed
from workers.contract.grid import Grid
from workers.contract.schedules import Schedule, schedule
from workers.contract.stage_replicas import StageReplicas


class MixSource(Section):
    """One entry of `data.mix`: a prepared directory (or object-store prefix) and its weight in the blend."""

    path: PathStr
    weight: PositiveFloat  # > 0 and finite (STRICT refuses inf and nan); the weights are normalised to shares


class DataSection(Section):
    """Where the prepared token shards live (see `raymesh prepare-data`): one directory (`path`), or a weighted
    mixture of several (`mix`, Megatron-Core's blended datasets; the order in `workers/data/blend.py`)."""

    path: PathStr | None = None
    mix: list[MixSource] | None = Field(default=None, min_length=1)
    seed: Seed = 0

    def sources(self) -> list[tuple[str, float]]:
        """Every training directory and its weight (one directory: weight 1)."""
        return [(entry.path, entry.weight) for entry in self.mix] if self.mix else [(self.path, 1.0)]


class ParallelSection(Section):
    """Mesh shape and placement; world size is dp * pp * cp * tp ranks."""

    dp: Annotated[int, Field(ge=1)] = 1
    pp: Annotated[int, Field(ge=1)] = 1
    tp: Annotated[int, Field(ge=1)] = 1
    cp: Annotated[int, Field(ge=1)] = 1  # context parallel: each sequence split over cp ranks
    cp_impl: Literal["ring", "ulysses", "allgather"] = "ring"  # which attention kernel joins the cp shares
    ep: Annotated[int, Field(ge=1)] = 1  # expert parallelism: MoE experts split over groups of ep dp x cp ranks
    expert_tp: bool = Field(False, description=(
        "Expert tensor parallelism (Megatron's expert_tensor_parallel_size = tp): with parallel.tp > 1 and "
        "parallel.ep > 1 each expert's w1/w3 are split column-wise and w2 row-wise over the tp group, so a rank "
        "holds 1/tp of its experts' weights; false (default): every tp rank holds its experts whole. Read by "
        "workers/parallel/expert_parallel.py, workers/state/expert_stacks.py, workers/model/hf_io.py (init_from) "
        "and the planner."))
    zero: Annotated[int, Field(ge=0, le=3)] = 0  # a bounded int, not Literal[0..3], which takes `true` as 1
    dp_shard: Annotated[int | None, Field(ge=1, description=(
        "Hybrid sharding (HSDP, ZeRO++'s hpZ): zero 1-3 shard their state inside groups of this many "
        "consecutive dp ranks (times cp) and replicate it across the dp / dp_shard groups, whose gradients "
        "meet in one all-reduce of the shard; must divide dp. None (default) or dp: shard over all of dp. "
        "Read by the mesh (workers/contract/grid.py), workers/parallel/data_parallel.py, "
        "distributed_optimizer.py and the planner (orchestrator/planning)."))] = None
    pp_schedule: PipelineSchedule = "1f1b"
    virtual_stages: Annotated[int, Field(ge=1)] | None = None
    # pp_schedule pipedream: every stage runs the version the first stage used for a microbatch (PipeDream's
    # vertical sync); pipedream_2bw: microbatches per weight version (default: train.microbatches)
    pp_vertical_sync: bool = False
    pp_2bw_every: PositiveInt | None = None
    # pipedream, pipedream_2bw: drain the pipeline at every step end (default: its steady state carries over)
    pp_flush_per_step: bool = False
    # layers per pipeline stage: even, auto (profiled costs + PipeDream's dynamic program, see
    # orchestrator/planning/stage_split.py) or one count per stage, virtual stages included
    pp_split: Literal["even", "auto"] | list[PositiveInt] = "even"
    stage_replicas: list[PositiveInt] | None = Field(default=None, min_length=2, description=(
        "PipeDream's stage replication: one degree per pipeline stage (stage s runs on that many ranks holding "
        "the same weights, microbatch m on its replica m mod degree, round-robin), so parallel.pp, the ranks of "
        "one pipeline, is their sum and the stages are as many as the list; pp_split then cuts the layers into "
        "these stages. Synchronous (a flush per step, GPipe's order; each stage's replicas all-reduce its "
        "gradients before the one optimizer step), so it trains as one process does. `raymesh plan` proposes one "
        "for an imbalanced split. pp_schedule gpipe only. Read by workers/contract/stage_replicas.py and "
        "workers/parallel/replicated_pipeline.py; planned by orchestrator/planning/stage_replicas.py."))
    sequence_parallel: bool = True
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cpus_per_rank: PositiveFloat = 1.0
    # ps: parameter-server shards (`parameter_server:` section); diloco: local steps, an outer step every
    # diloco_inner_steps (workers/step/diloco.py)
    dp_sync: Literal["allreduce", "ps", "diloco"] = "allreduce"
    diloco_inner_steps: Annotated[int, Field(ge=1, le=100_000, description=(
        "dp_sync diloco: H, the steps each data-parallel replica takes on its own data with its own optimizer "
        "between two outer steps; the replicas' weights cross the dp group once per H steps (the DiLoCo paper "
        "uses 500 on large models; 8 costs 1/8 of all-reduce's dp bytes per step). Read by "
        "workers/step/diloco.py."))] = 8
    diloco_outer_lr: Annotated[float, Field(gt=0, le=10, description=(
        "dp_sync diloco: the outer optimizer's learning rate (Nesterov SGD on the averaged pseudo-gradient, "
        "theta_outer - theta_local); 0.7 as Douillard et al. 2023. Read by workers/step/diloco.py."))] = 0.7
    diloco_outer_momentum: Annotated[float, Field(ge=0, lt=1, description=(
        "dp_sync diloco: the outer Nesterov momentum, in [0, 1); 0.9 as Douillard et al. 2023 (0 with "
        "diloco_outer_lr 1 is plain weight averaging, LocalSGD). Read by workers/step/diloco.py."))] = 0.9
    # zero 0: gradients are averaged in buckets of about this many MiB as backward produces them (overlapping
    # it; 25 is DDP's default); 0: one bucket, averaged after backward (no overlap)
    bucket_mb: Annotated[float, Field(ge=0, le=1_000_000)] = 25.0  # up to a terabyte: one bucket in practice
    # zero 0 (powersgd, topk: zero 1 too): how gradient buckets cross data parallelism (all lossy but none;
    # workers/parallel/grad_compression.py)
    grad_compression: Literal[KINDS] = "none"  # type: ignore[valid-type]
    powersgd_rank: PositiveInt = 4  # grad_compression powersgd: rank of the gradient matrices' factors
    # grad_compression powersgd: steps of plain all-reduce before compressing (PyTorch's start_powerSGD_iter);
    # 10 cut the worst loss gap over 200 steps from 7.9% to 2.2% (README, "Gradient communication")
    powersgd_warmup_steps: Annotated[int, Field(ge=0)] = 10
    topk_ratio: Annotated[float, Field(gt=0, le=1)] = 0.01  # grad_compression topk: share of entries sent
    # zero 2/3: FSDP2 all-gathers issued this many blocks ahead in forward and backward; 0: FSDP2's own order
    fsdp_prefetch: Annotated[int, Field(ge=0, le=64)] = 0
    fsdp_bucket_mb: float | None = Field(
        None, gt=0, le=1_000_000, description="ZeRO-R's constant-size buffers for ZeRO-2/3 "
        "(workers/parallel/data_parallel.py::fsdp_units): "
        "consecutive blocks grouped into one FSDP2 unit while their parameters (as all-gathered: this rank's tp "
        "shard, in the all-gather's dtype) stay within this many MiB, so every all-gather and reduce-scatter of the "
        "blocks moves at most one bucket (a block larger than it is a unit alone) and at most one bucket's "
        "parameters (plus prefetch) is whole at a time. null: one unit per block. Not with fsdp_prefetch or "
        "memory.offload.params, which address units block by block")
    grad_reduce_dtype: Literal["fp32", "bf16"] = Field("fp32", description=(
        "Low-precision gradient reduction for sharded data parallelism (ZeRO 1-3, ZeRO++'s quantized gradients "
        "in bf16): the reduce-scatter (and hybrid sharding's cross-replica all-reduce) moves bf16, half the bytes; "
        "the reduced gradient is cast back to fp32 before the optimizer. Error per element at most about "
        "(n + 1) * 2^-8 of the sum of |g| over the n ranks. ZeRO-0 compresses with grad_compression instead; under "
        "FSDP2's bf16 policy precision.reduce_dtype sets it. Read by workers/parallel/data_parallel.py and "
        "distributed_optimizer.py, priced by orchestrator/planning/comm_model.py."))
    param_gather_dtype: Literal["fp32", "bf16", "int8"] = Field("fp32", description=(
        "Low-precision parameter all-gather for sharded data parallelism (ZeRO++'s quantized weights, qwZ). ZeRO-1: "
        "after each rank steps its fp32 slice, the slices travel as bf16 (half the bytes) or as int8 codes with one "
        "fp32 scale per block of 256 values (about 3.9x fewer bytes), and every rank, the owner included, computes "
        "with the dequantized values while the owner's fp32 master slice, which the optimizer steps and checkpoints "
        "save, stays exact. ZeRO-2/3: FSDP2's gathers carry the same codes (blocks per rank's shard) through its "
        "all-gather extensions while the fp32 shards stay what the optimizer steps and checkpoints save; a parameter "
        "whose rows do not split evenly over the ranks goes as bf16 under int8. Error per element: int8 at most "
        "max|block|/254, bf16 at most 2^-8 relative. Needs dp_sync allreduce and more than one dp rank; at ZeRO-2/3 "
        "not with tp > 1, train.compile or memory.offload.params. Read by workers/parallel/distributed_optimizer.py "
        "and fsdp_quantized_gather.py, priced by orchestrator/planning/comm_model.py."))
    # bytes per device for the planner's fit check (`80GB`, `80GiB` or a number); default: the GPU's own
    device_memory: int | str | None = None

    @property
    def pipeline_schedule(self) -> Schedule:
        """The facts of `pp_schedule` (workers.contract.schedules' table)."""
        return schedule(self.pp_schedule)

    @property
    def stages_per_rank(self) -> int:
        """Model chunks per pp rank: `virtual_stages`, else the schedule's default (1 for gpipe/1f1b, else 2)."""
        if self.virtual_stages is not None:
            return self.virtual_stages
        return self.pipeline_schedule.default_stages_per_rank

    @property
    def replicated_stages(self) -> StageReplicas | None:
        """`stage_replicas` as arithmetic (``workers.contract.stage_replicas``); None for a plain pipeline."""
        return None if self.stage_replicas is None else StageReplicas(tuple(self.stage_replicas))

    @property
    def n_stages(self) -> int:
        """Pipeline stages: one per `stage_replicas` entry, else `pp * stages_per_rank`."""
        if self.stage_replicas is not None:
            return len(self.stage_replicas)
        return self.pp * self.stages_per_rank

    @property
    def stage_layers(self) -> tuple[int, ...] | None:
        """Layers per pipeline stage as the ranks cut them: `pp_split` as `JobSpec.worker_dict` writes it (a list),
        None for an even split. `auto` needs the driver's profile, so a rank refuses it unresolved."""
        if self.pp_split == "auto":
            raise ValueError("parallel.pp_split 'auto' reached a rank unresolved; send the dict JobSpec.worker_dict() "
                             "builds once the planner has pinned the split (orchestrator.planning.stage_split."
                             "pin_split profiles the model and writes one layer count per stage)")
        return None if self.pp_split == "even" else tuple(self.pp_split)

    @property
    def grid(self) -> Grid:
        """The rank grid of these degrees: coordinates, mesh dims and replica peers come from it."""
        return Grid.from_parallel(self)

    @property
    def world_size(self) -> int:
        return self.grid.world_size


class OptimSection(Section):
    """Optimizer and learning-rate schedule."""

    # adafactor: PyTorch's; sm3: ours (workers/optim/sm3.py); paged_adamw: AdamW with its state in the offload store;
    # onebit_adam: AdamW whose momentum crosses data parallelism as signs after warmup_steps (optim/onebit_adam.py);
    # muon: PyTorch's Muon for the blocks' matrices, AdamW (betas) for embeddings, head, norms, experts (optim/muon.py)
    name: Literal["adamw", "adam", "sgd", "adafactor", "sm3", "paged_adamw", "onebit_adam", "muon"] = "adamw"
    lr: PositiveFloat = 3e-3
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    # which parameters weight_decay spares: 1d, those of fewer than 2 dimensions (norm weights, biases), as Megatron
    # and nanoGPT; none: every parameter decays (torchtitan). Every optimizer path and the PS shards alike
    weight_decay_exclude: Literal["1d", "none"] = "1d"
    betas: Betas = (0.9, 0.95)
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.0
    grad_clip: Annotated[float, Field(ge=0)] = 1.0  # 0 disables clipping
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    # after warm-up: constant; cosine or linear decay to min_lr_ratio at train.steps; wsd: constant, then the last
    # decay_steps (or decay_ratio of train.steps) decay to min_lr_ratio in decay_shape (workers/optim/build.py)
    schedule: Literal["constant", "cosine", "linear", "wsd"] = "constant"
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    decay_steps: PositiveInt | None = None  # wsd: the decay's length in steps (instead of decay_ratio)
    decay_ratio: Annotated[float, Field(gt=0, le=1)] = 0.1  # wsd: the decay's share of train.steps
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = "linear"  # wsd: the decay's curve
    # PyTorch's kernels for the update: auto (fused for adam/adamw/sgd on CUDA, else PyTorch's default),
    # fused, foreach or for_loop (workers/optim/implementations.py)
    implementation: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    # muon only (torch.optim.Muon's knobs): momentum of each matrix's one buffer, Nesterov's look-ahead, Newton-Schulz
    # iterations. Its rate is scaled per matrix as Moonlight's (match_rms_adamw), so optim.lr and weight_decay tuned
    # for AdamW carry over, and one optim.lr serves both parts (workers/optim/muon.py)
    muon_momentum: Annotated[float, Field(ge=0, lt=1)] = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: Annotated[int, Field(ge=1, le=99)] = 5
    state_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="The dtype adam/adamw store their two moments in: fp32 (PyTorch's optimizers), or bf16, "
        "half their bytes (workers/optim/state_dtype.py updates in float32 and rounds the moments back). Checkpoints, "
        "snapshots and resharding keep the stored dtype; the planner counts 4 bytes per parameter instead of 8. "
        "adam and adamw only, stepped on the device (not the offloaded or parameter-server optimizers).")


class PrecisionSection(Section):
    """Compute precision. bf16 runs through FSDP2's mixed-precision policy or autocast (``policy``; the rule and
    what each keeps: workers/contract/mixed_precision.py); fp16 runs under autocast with dynamic loss scaling."""

    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    initial_loss_scale: PositiveFloat = 65536.0
    # auto: FSDP2's policy for bf16 with ZeRO-2/3 on a GPU, autocast elsewhere; fsdp: that policy wherever it applies
    policy: Literal["auto", "autocast", "fsdp"] = "auto"
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"  # gradient reduction (and accumulation) under FSDP2's policy
    float8: Literal["none", "tensorwise", "rowwise"] = Field(
        "none", description="The blocks' linear layers compute in float8 through torchao's float8 training "
        "(workers/model/float8.py): tensorwise (one scale per tensor; FSDP2 all-gathers float8 weights) or rowwise "
        "(one scale per row); the head, embeddings and MoE routers stay in precision.dtype. Needs compute capability "
        "8.9+ on a GPU; emulated on CPU. Weights, optimizer state and checkpoints stay plain.")


class OffloadSection(Section):
    """What leaves the device for the offload store (workers/offload/), and which tier holds it."""

    optimizer: bool = False  # Adam moments (+ fp32 master weights off the host) live in the store
    params: bool = False  # ZeRO-3 parameter shards live in the store between uses (needs optimizer offload)
    activations: bool = False  # saved activations go to the store in forward, come back for backward
    tier: Literal["cpu", "nvme"] = "cpu"
    path: PathStr | None = None  # directory for nvme files (required for tier nvme)
    prefetch: Annotated[int, Field(ge=0)] = 1  # items fetched ahead of use
    page_at: Annotated[float | None, Field(
        default=None, gt=0, lt=1,
        description="Paged optimizer (workers/offload/paged.py): the optimizer's state stays on the device and is "
                    "put in the store (tier) only after a step whose peak, counting the state, reached this "
                    "fraction of device memory (host memory on a CPU device, which needs tier nvme); fetched back "
                    "for the next step. In (0, 1); unset: no paging (paged_adamw then keeps its state in the store "
                    "always). For adamw, adam, sgd, adafactor, sm3 and paged_adamw, without memory.offload.optimizer")]


class MemorySection(Section):
    # unset (None): picked (orchestrator/planning/fast_defaults.py); meaning in orchestrator/spec/field_docs.py.
    # sqrt: segments of round(√n_layers) blocks, each storing its input and recomputed whole (Chen et al. 2016)
    recompute: Literal["none", "selective", "full", "sqrt"] | None = None
    recompute_every: Annotated[int, Field(ge=1)] = 1  # recompute only blocks whose layer index is a multiple
    offload: OffloadSection = Field(default_factory=OffloadSection)
    activation_compression: Literal["none", "bf16", "fp8"] = "none"  # lossy: saved activations kept in this dtype
    partition_activations: Literal["none", "device", "host"] = Field(
        "none", description="ZeRO-R's partitioned activation checkpoints (Pa; workers/parallel/"
        "partitioned_activations.py): under memory.recompute full or sqrt with parallel.tp > 1 and "
        "sequence_parallel false, each tp rank keeps 1/tp of every stored block input (the input is the same on all "
        "of them) and all-gathers it over tp before the block is recomputed; device: the slice stays on the device; "
        "host: it waits in host memory (Pa+cpu; also at tp 1, where the slice is the whole input). none: whole "
        "inputs, as before")
    contiguous_checkpoints: bool = Field(
        False, description="ZeRO-R's contiguous buffers (defragmentation; workers/parallel/partitioned_activations.py"
        "::Arena): the slices memory.partition_activations keeps are cut from one buffer reused every microbatch "
        "(sized by the first), not allocated one by one between the activations. Needs memory.partition_activations "
        "(device at tp 1 then keeps whole inputs, in that buffer)")
    measure: bool = False  # each rank measures its tensor bytes per category; the summary's `memory` compares them
    # the planner refuses layouts whose predicted in-step peak passes (1 - headroom) of device memory
    headroom: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.1


class BatchRampSection(Section):
    """`train.batch_ramp`: the global batch grows from `start` sequences to `train.global_batch_size` over the first
    `steps` steps, in whole `increment`s, then stays there (GPT-3's batch-size ramp-up; the batch size is a resource
    spent where it pays, seed 002 lines 179-184). The data position counts sequences, so a resumed run goes on with
    the batch its step has (``workers.step.hooks.BatchRamp``). Each size is a multiple of dp * microbatches
    (``orchestrator.spec.checks.batching.check_batch_ramp``)."""

    start: PositiveInt = Field(description="the first step's global batch in sequences, below global_batch_size")
    steps: PositiveInt = Field(description="steps the ramp takes to reach train.global_batch_size")
    increment: PositiveInt | None = Field(default=None, description="the batch grows in multiples of this many "
                                          "sequences; null: start")

    def batch_at(self, step: int, full: int) -> int:
        """The global batch of step ``step`` (1-based): ``start`` plus the whole increments a straight line from
        ``start`` at step 1 to ``full`` at step ``steps`` + 1 has reached; ``full`` from then on."""
        if step > self.steps:
            return full
        inc = self.increment or self.start
        return min(full, self.start + inc * ((step - 1) * (full - self.start) // (inc * self.steps)))


class TrainSection(Section):
    """Loop length and batching.

    `microbatches` is gradient-accumulation steps per data rank when pp == 1,
    and pipeline microbatches when pp > 1.
    """

    steps: PositiveInt = 100
    global_batch_size: PositiveInt = 16
    microbatches: PositiveInt = 1
    batch_ramp: BatchRampSection | None = Field(
        default=None, description="batch-size ramp-up: the global batch grows from batch_ramp.start to "
        "global_batch_size over batch_ramp.steps steps (workers.step.hooks.BatchRamp); null: every step takes "
        "global_batch_size sequences; not with parallel.pp > 1 or dp_sync ps")
    seed: Seed = 0
    log_every: PositiveInt = 1
    compile: bool | None = None  # unset (None): picked, as memory.recompute
    # the head and cross entropy per chunk of each sequence under torch.utils.checkpoint, so the [tokens, vocab]
    # logits never exist whole (workers/model/gpt.py::chunked_lm_loss); 1: the whole logits, as before
    loss_chunks: PositiveInt = 1
    # lm: next-token cross entropy; dpo: Direct Preference Optimization on `prepare-data --format preference` pairs,
    # the reference policy the model with its LoRA adapters disabled (workers/model/dpo.py). A rank runs any
    # objective registered in workers/step/objectives.py; the job file offers the built-in ones (TrainSpec)
    objective: Annotated[str, Field(min_length=1)] = "lm"
    # dpo: how far from the reference the policy may move (TRL's beta, usually 0.01-0.5); bounded so the rewards
    # beta * (log-probability difference) stay finite in float32
    dpo_beta: Annotated[float, Field(gt=0, le=1000)] = 0.1


class EvalSection(Section):
    """Held-out loss during training (``workers/evaluation.py``): the same sequences of a prepared directory the
    model does not train on, scored with gradients off after every `every`-th step and after the last."""

    every: Annotated[int, Field(ge=0)] = 0  # steps between evaluations; 0: never
    path: PathStr | None = None  # a prepared directory (`raymesh prepare-data --heldout` writes DATA/heldout)
    # batches of train.global_batch_size sequences per evaluation (a million batches is far past any eval set)
    batches: Annotated[int, Field(gt=0, le=1_000_000)] = 4

    def due(self, step: int, last: int) -> bool:
        """Whether the model is scored after optimizer step ``step`` (1-based) of a run ending at step ``last``:
        after every ``every``-th step and after the last."""
        return self.every > 0 and (step % self.every == 0 or step == last)


# shards are Ray actors (one CPU-light process each, plus its gRPC port): far more than any cluster runs
MAX_PS_SHARDS = 1024
PSShardCount = Annotated[int, Field(ge=1, le=MAX_PS_SHARDS)]


class PSResize(Section):
    """One scheduled change of the shard count: step ``at_step`` and the ones after it run on ``shards`` shards."""

    at_step: Annotated[int, Field(ge=2)]  # the chunks move between step at_step - 1 and step at_step
    shards: PSShardCount


class ParameterServerSection(Section):
    """Parameter-server shards, used when `parallel.dp_sync: ps` (see parameter_server/)."""

    shards: PSShardCount = 2
    consistency: Literal["bsp", "asp", "ssp"] = "bsp"
    staleness: Annotated[int, Field(ge=0)] = 2  # ssp: a worker at clock c reads once the slowest reached c - staleness
    # how workers reach shards; gRPC is served either way (on loopback under "ray" on a one-node cluster)
    transport: Literal["ray", "grpc"] = "ray"
    optimizer: Literal["sgd", "momentum", "adam", "adamw"] | None = None  # None: optim.name
    chunk_elems: PositiveInt = 65536  # tensors are cut into chunks of at most this many elements
    virtual_nodes: PositiveInt = 64  # points per shard on the consistent-hash ring
    snapshot_every: Annotated[int, Field(ge=0)] = 0  # steps between shard snapshots to <run_dir>/ps; 0: off
    # lossy: pushes in bf16 (pulls too), or the top-k share of each gradient chunk with error feedback on the worker
    compression: Literal[PS_KINDS] = "none"  # type: ignore[valid-type]
    topk_ratio: Annotated[float, Field(gt=0, le=1)] = 0.01  # compression topk: share of each chunk's entries sent
    # add or remove shards between steps ({at_step, shards} each; consistent hashing moves only the affected chunks)
    resize: list[PSResize] = Field(default_factory=list)
    tls_cert: str | None = None  # PEM certificate chain naming the shards' addresses; with tls_key, gRPC is TLS only
    tls_key: str | None = None  # PEM private key of tls_cert


class LoraSection(Section):
    """Low-rank adapters on the Linear layers named by `targets`; everything else frozen."""

    rank: Annotated[int, Field(gt=0)] = 8
    alpha: Annotated[float, Field(gt=0)] = 16.0  # adapter output scaled by alpha / rank
    # null: the model family's default (ModelSpec fills it in, e.g. gpt: wq wk wv wo w1 w2; llama adds w3)
    targets: Annotated[list[str], Field(min_length=1)] | None = None
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    quantize: Literal["nf4"] | None = None  # QLoRA: frozen base weights of the adapted layers stored as NF4
    base_checkpoint: PathStr | None = None  # a full run's DCP step directory, or a .pt from `raymesh export-merged`


class FineTuningSection(Section):
    """The `model:` fields beside its shape (``workers.model.config.ModelConfig``) that decide where the weights
    start and which of them train."""

    # a Hugging Face directory (save_pretrained's): shape from config.json, weights loaded at start; a Llama,
    # Mistral, Qwen2/3, Qwen3-MoE or Mixtral becomes raymesh's Llama, any other causal LM model.arch hf
    init_from: PathStr | None = None
    lora: LoraSection | None = None  # LoRA/QLoRA fine-tuning; null: train every weight


class MetricsSection(Section):
    """What a rank records for the step records (the endpoint's fields are the controller's: ``MetricsSpec``)."""

    timeline: bool = False  # record every pipeline F/B/W event (and gradient bucket reduction) for `raymesh report`
    # count the bytes each collective sends, per mesh dimension, into every step record (`comm_bytes`); off by
    # default: the counter sees every tensor op (~10 us each in Python), which doubles a tiny CPU model's step
    comm_bytes: bool = False


class FaultToleranceSection(Section):
    """What a rank itself does about failures (the rest is the controller's: ``FaultToleranceSpec``)."""

    collective_timeout_s: Seconds = 60.0  # survivors' collectives with a dead peer give up
    snapshot_compression: Literal["none", "zlib"] = Field(
        default="none", description="zlib: in-memory snapshots (a rank's own, the replica shipped to and kept by its "
        "peer) kept losslessly compressed, byte planes then DEFLATE (workers/state/lossless.py), about 16% smaller "
        "for float32 state at ~1 s of CPU per 10 MB; none: plain host copies")
