"""One rank's training loop: forward/backward (plain or pipelined), reduce, step.

The trainer knows nothing of Ray or the controller: it takes the plain job
spec dict (parsed once into a ``WorkerSpec``) and its rank, so the same code runs inside a ``RankWorker`` actor,
under ``torchrun`` (the benchmark baseline) or single-process (the reference).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import warnings
import zlib

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from workers.data import DataCursor, MixedDataset, open_data
from workers.data.loader import IGNORE_INDEX, document_eos
from workers.diagnostics.comm_bytes import CommBytes, mesh_dim_groups
from workers.diagnostics.faults import NO_FAULT, StepFault
from workers.diagnostics.memory_probe import ActivationMeter, live_state_bytes, model_state_bytes
from workers.diagnostics.timeline import busy_seconds
from workers.evaluation import EvalData, Evaluator, PipelineSweep
from workers.model import moe
from workers.model.documents import attending, split_documents
from workers.model.dpo import RewardTally, pair_losses, sequence_logps
from workers.model.gpt import model_loss
from workers.model.lora import adapters_disabled
from workers.offload.activations import activation_policy
from workers.offload.host_memory import release_freed_buffers
from workers.offload.params import offload_params
from workers.optim.build import build_optimizer, clip_grads, lr_lambda
from workers.optim.loss_scaler import DynamicLossScaler
from workers.optim.onebit_adam import OneBitAdam
from workers.parallel.async_pipeline import AsyncPipeline, rules_for
from workers.parallel.compression_kinds import WITH_FEEDBACK
from workers.parallel.data_parallel import unwrap
from workers.parallel.distributed_optimizer import sliced_optimizer
from workers.parallel.layout import stage_owners
from workers.parallel.parallelize import build_parts
from workers.parallel.process_group import data_parallel_dim, data_parallel_mesh, init_mesh, pick_device
from workers.parallel.ps_sync import PSSync
from workers.parallel.recompute import checkpointed_modules
from workers.parallel.schedules import schedule as schedule_facts
from workers.protocol import StepResult, StepTimes
from workers.spec import WorkerSpec
from workers.state.checkpoint_io import CheckpointIO
from workers.state.compression_feedback import CompressionFeedback
from workers.state.train_state import TrainState

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
log = logging.getLogger(__name__)


class Trainer:
    """One rank: its share of the model (``parts``), its ``TrainState`` and the step that advances it."""

    def __init__(self, spec: dict, rank: int, world_size: int, master_addr: str, master_port: int,
                 listener: socket.socket | None = None):
        self.spec = WorkerSpec.from_dict(spec)
        self.rank = rank
        par, memory = self.spec.parallel, spec["memory"]
        self.grid = par.grid
        self.coords = self.grid.coords(rank)
        self.device = pick_device(par.device)
        if self.spec.memory.offloads_params:
            release_freed_buffers()  # before the model is built, so evicted shards' host memory goes back to the OS
        self.mesh = init_mesh(rank, world_size, master_addr, master_port, self.grid,
                              self.device, timeout_s=self.spec.collective_timeout_s, listener=listener)
        self.parts = build_parts(self.spec, self.mesh, self.device)
        self.params = [p for m in self.parts.modules for p in m.parameters()]
        # expert parallelism: the experts' gradient norm is summed over the ep ranks that split them
        self.expert_norm = ([p for e in self.parts.experts for p in e.parameters()], self.parts.ep_group) \
            if self.parts.ep_group is not None else ()
        self.param_offload = offload_params(self.parts.modules, memory, self.device)
        self.state = self._train_state(spec)
        feedback = self._error_feedback()
        if feedback:  # each rank's own, kept across recoveries and resumes
            self.state.wire_feedback = CompressionFeedback(feedback, self._feedback_layout(), rank, self.device)
        self.activations = activation_policy(memory, self.device)
        # under FSDP2's mixed-precision policy the bf16 parameters set the compute dtype; no autocast on top
        mixed = self.spec.fsdp_mixed(self.device.type == "cuda")
        self.autocast_dtype = None if mixed else AUTOCAST.get(self.spec.precision.dtype)
        train = self.spec.train
        self.microbatches = train.microbatches
        self.pp_group = self.mesh["pp"].get_group() if par.grid.pp_enabled else None
        self.dp_group = self.mesh["dp"].get_group() if par.grid.dp_enabled else None
        self.schedule, self.pipe_stages, self.async_pipe = None, [], None
        if par.grid.pp_enabled and schedule_facts(par.pp_schedule).asynchronous:
            self.async_pipe = self._async_pipeline()
            self.pipe_stages = [self.async_pipe]
        elif par.grid.pp_enabled:
            from workers.parallel.pipeline import build_schedule  # here: torch's pipelining imports Dynamo (~1 s)

            self.schedule, self.pipe_stages = build_schedule(
                self.parts.modules, self.parts.stage_ids, self.parts.n_stages, par.pp_schedule,
                self.microbatches, self._microbatch_loss, self.device, self.pp_group,
            )
        self.fault = NO_FAULT  # this step's injected fault (the loss reads it inside pipeline schedules)
        self.checkpoints = CheckpointIO(self.state)
        self.ps = PSSync(self, self.spec) if par.dp_sync == "ps" else None
        self.comm = CommBytes(mesh_dim_groups(self.mesh, data_parallel_mesh(self.mesh, self.grid)),
                              self.grid.mesh_dims) if self.spec.count_comm_bytes else None
        self.compute_events: list[dict] = []  # forward+backward per microbatch without a pipeline schedule
        # under a loss mask, a counted target's share of the step's loss (`_count_targets`); None: the mean
        self.counted_scale: float | None = None
        # train.objective: dpo: this step's reward figures, and the reference policy's sequence log-probabilities
        # of the microbatch running (`_score_reference`)
        self.dpo = train.objective == "dpo"
        self.rewards: RewardTally | None = None  # made at each step's start under dpo
        self.reference: torch.Tensor | None = None
        self.evaluator = self._evaluator()

    def _error_feedback(self) -> list:
        """What compression held back on this rank, one holder per stage module: PowerSGD's and top-k's hooks,
        or 1-bit Adam's optimizers (``feedback``); empty when nothing is compressed with error feedback."""
        if self.spec.parallel.grad_compression in WITH_FEEDBACK:
            return [r.hook for r in self.parts.reducers]
        return [opt.feedback for opt in self.state.optimizers if isinstance(opt, OneBitAdam)]

    def _feedback_layout(self) -> str:
        """What decides which tensors a rank's error feedback belongs to, naming its checkpoint entry: the layout,
        and for PowerSGD's and top-k's (one residual per gradient bucket) how the gradients are bucketed, since
        another ``parallel.bucket_mb`` may cut other buckets under the same indices (a residual of one size added
        to a bucket of another failed the step; of equal sizes, it went to other parameters). The buckets are
        named by their sizes in elements: cut from the same ordered parameters, equal sizes are equal buckets,
        so a bucket_mb change that cuts the same buckets keeps the feedback. Another entry name: the feedback
        starts at zero, as at another layout."""
        par = self.spec.parallel
        layout = f"dp{par.dp}.pp{par.pp}.tp{par.tp}.cp{par.grid.cp}.ep{par.grid.ep}.v{par.virtual_stages}"
        if par.grad_compression not in WITH_FEEDBACK:
            return layout
        sizes = [[sum(p.numel() for p in b.params) for b in r.buckets] for r in self.parts.reducers]
        return f"{layout}.buckets{zlib.crc32(repr(sizes).encode()):08x}"

    def _async_pipeline(self) -> AsyncPipeline:
        """PipeDream's executor for this rank's one stage; it steps the optimizer itself, between microbatches,
        and its stashed versions travel with the ``TrainState`` into checkpoints and snapshots."""
        par = self.spec.parallel
        rules = rules_for(par.pp_schedule, par.pp_2bw_every or self.microbatches, par.pp_vertical_sync)
        pipe = AsyncPipeline(self.parts.modules[0], self.parts.stage_ids[0], self.parts.n_stages, self.microbatches,
                             rules, self.state.optimizers[0], self._loss_fn, self.pp_group, self.dp_group,
                             self.spec.grad_clip, self.device)
        self.state.weight_versions = pipe
        return pipe

    def _evaluator(self) -> Evaluator | None:
        """The held-out scorer when the job has ``eval.every`` (``workers.evaluation``), else None."""
        ev, par, train = self.spec.eval, self.spec.parallel, self.spec.train
        if not ev.every:
            return None
        data = EvalData(ev.path, self.spec.model.seq_len, self.spec.data.seed, ev.batches, train.global_batch_size,
                        self.coords.dp, par.dp, self.coords.cp, par.grid.cp, self.spec.model.attention_mask)
        sweep = None
        if par.grid.pp_enabled:
            sweep = PipelineSweep(dict(zip(self.parts.stage_ids, self.parts.modules)),
                                  stage_owners(par.pp, par.virtual_stages, par.pp_schedule), self.pp_group, self.device)
        return Evaluator(self.parts.modules, data, self.microbatches, self.device, self._autocast, sweep,
                         self.head_part)

    def _train_state(self, spec: dict) -> TrainState:
        """Optimizers, LR schedulers, data cursor and loss scaler around the built model parts."""
        par, memory = self.spec.parallel, spec["memory"]
        # ZeRO-1: each part's optimizer steps this rank's slices of the part's parameters (distributed_optimizer.py)
        dp_mesh = data_parallel_mesh(self.mesh, par.grid)  # dp, or dp x cp: the ranks gradients are averaged over
        sliced = self.parts.modules if par.zero == 1 and dp_mesh.size() > 1 else []
        dp_dim = data_parallel_dim(par.grid)
        held = frozenset(id(p) for e in self.parts.experts for p in e.parameters())  # sliced over edp instead
        self.zero1 = [sliced_optimizer(unwrap(m).named_parameters(), self.mesh, dp_dim, held, self.parts.expert_mesh)
                      for m in sliced]
        if self.zero1 and held:  # the clip reads the experts' slices: summed over ep, as their weights would be
            names = {n for m in sliced for n, p in unwrap(m).named_parameters() if id(p) in held}
            shards = [s for z in self.zero1 for n, s in z.shards.items() if n in names]
            self.expert_norm = (shards, self.parts.ep_group)
        stepped = [list(z.shards.items()) for z in self.zero1] or [list(unwrap(m).named_parameters())
                                                                   for m in self.parts.modules]
        dp = dp_mesh.get_group() if dp_mesh.size() > 1 else None  # onebit_adam's momentum average
        optimizers = [build_optimizer([p for _, p in named], spec["optim"], memory, self.device, self.param_offload,
                                      dp_group=dp, names=[n for n, _ in named]) for named in stepped]
        steps = self.spec.train.steps
        schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(spec["optim"], steps)) for o in optimizers]
        precision, data = self.spec.precision, self.spec.data
        scaler = DynamicLossScaler(precision.initial_loss_scale) if precision.dtype == "fp16" else None
        dataset = open_data(data.path, data.sources(), self.spec.model.seq_len, data.seed)
        cursor = DataCursor(dataset, self.spec.train.global_batch_size, self.coords.dp, par.dp,
                            cp_rank=self.coords.cp, cp_size=par.grid.cp,
                            eos_id=document_eos(self.spec.model.attention_mask, dataset))
        named = [z.module() for z in self.zero1] or None
        return TrainState(self.parts.modules, optimizers, schedulers, cursor, scaler, self.param_offload, named,
                          self.parts.expert_mesh)

    # -- one step -------------------------------------------------------------------------

    @property
    def holds_last_stage(self) -> bool:
        return self.parts.n_stages - 1 in self.parts.stage_ids

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.parts.stage_ids

    @property
    def head_part(self) -> torch.nn.Module | None:
        """The model part holding the last stage (its head), unwrapped; None where this rank holds none."""
        if not self.holds_last_stage:
            return None
        return unwrap(self.parts.modules[self.parts.stage_ids.index(self.parts.n_stages - 1)])

    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The microbatch's mean token loss, or under a loss mask its counted targets' summed loss times their
        share (`counted_scale`); poisoned by a NaN fault, times the fp16 loss scale. ``logits``: the last stage's
        output, its final hidden state under ``train.loss_chunks`` > 1 (``model_loss`` applies the head). Under
        ``train.objective: dpo``, the microbatch's mean DPO loss over its pairs instead (`_dpo_loss`)."""
        if self.dpo:
            loss = self._dpo_loss(logits, targets)
        elif self.counted_scale is None:
            loss = model_loss(self.head_part, logits, targets)
        else:
            loss = model_loss(self.head_part, logits, targets, reduction="sum") * self.counted_scale
        if self.fault.poisons_loss:
            loss = loss * float("nan")
        return loss * self.state.scaler.scale if self.state.scaler else loss

    def _dpo_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean DPO loss of the microbatch's pairs against `reference` (``workers.model.dpo``), its rewards
        tallied. A mean per microbatch over their count and over dp is the global batch's mean, since every
        microbatch holds the same number of pairs (``orchestrator/spec/dpo_checks.py``)."""
        losses, rewards = pair_losses(sequence_logps(logits, targets), self.reference, self.spec.train.dpo_beta)
        self.rewards.add(rewards)
        return losses.mean()

    def _score_reference(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Under dpo, the reference policy's sequence log-probabilities of this microbatch into `reference`: one
        forward without gradients with the LoRA adapters disabled (the same weights, no second copy), past any
        DDP wrapper (nothing to reduce); FSDP2 gathers and frees the shards around it as around any forward."""
        if not self.dpo:
            return
        with torch.no_grad(), adapters_disabled([model]):
            self.reference = sequence_logps(unwrap(model)(inputs), targets)

    def _microbatch_loss(self, logits: torch.Tensor, targets: torch.Tensor, parts: int | None = None) -> torch.Tensor:
        """A microbatch's share of the step's loss (pipeline schedules and accumulation sum gradients, unscaled):
        its mean over ``parts`` (the microbatches), or under a loss mask its counted targets' share already."""
        loss = self._loss_fn(logits, targets)
        return loss if self.counted_scale is not None else loss / (parts or self.microbatches)

    def _count_targets(self, targets: torch.Tensor) -> None:
        """Under a loss mask, set `counted_scale` so that the step's loss is the sum of cross entropy over every
        counted target of the global batch over their global count, whatever the layout: microbatches and ranks
        hold different counts, so a mean per microbatch averaged would weigh their targets unequally. One
        all-reduce of this rank's count over the ranks gradients are averaged over (dp, x cp: those hold other
        targets; tp and pp peers the same), whose averaging the scale undoes (x their number)."""
        if not self.state.cursor.dataset.loss_mask or self.dpo:  # dpo: a mean over pairs, not over tokens
            return
        count = (targets != IGNORE_INDEX).sum()
        dp_mesh = data_parallel_mesh(self.mesh, self.grid)
        if dp_mesh.size() > 1:
            dist.all_reduce(count, group=dp_mesh.get_group())
        total = int(count)
        if total == 0 and self.rank == 0:
            log.warning("step %d: no target of the global batch is a completion token (the loss mask of %s hides "
                        "them all); its loss is 0 and its gradients zero", self.step, self.state.cursor.dataset.path)
        self.counted_scale = dp_mesh.size() / max(total, 1)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Summed mean loss of this rank's microbatches (``None`` where no last stage lives).

        Under ``model.attention_mask: document`` each microbatch's document ids (of the batch the cursor just
        gave, whole windows: every rank has them, pipeline stages without tokens and cp shares too) are on the
        attention cores while it runs forward and backward (recompute replays the forward there)."""
        documents = split_documents(self.state.cursor.documents, self.microbatches, self.device)
        if self.async_pipe is not None:
            with self._autocast(), self.activations.hooks():
                return self.async_pipe.run(inputs, targets, self.step, drain=self._drains_pipeline())
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            # contiguous: the loader's token windows are views ([:, :-1] has stride seq+1), and torch 2.11's
            # PipelineStage refuses an input whose strides differ from the contiguous ones it expects
            args = (inputs.contiguous(),) if self.holds_first_stage else ()
            for stage in self.pipe_stages:
                stage.documents = documents  # each chunk's, put on its cores by TimedStage._timed
            with self._autocast(), self.activations.hooks():
                self.schedule.step(*args, target=targets if self.holds_last_stage else None, losses=losses)
            if not self.holds_last_stage:
                return None
            return torch.stack([loss.detach().float() for loss in losses]).sum()  # shares of the mean
        model = self.parts.modules[0]
        total = torch.zeros((), device=self.device)
        chunks = list(zip(inputs.chunk(self.microbatches), targets.chunk(self.microbatches)))
        for i, (x, y) in enumerate(chunks):
            last = i == len(chunks) - 1
            start = time.time()
            with self._sync_grads(model, last), self._autocast(), self.activations.hooks(), \
                    attending([model], documents[i]):
                self._score_reference(model, x, y)
                loss = self._microbatch_loss(model(x), y, len(chunks))
                loss.backward()
            self.compute_events.append({"stage": 0, "microbatch": i, "kind": "FB", "start": start, "end": time.time()})
            total += loss.detach().float()
        return total

    def _drains_pipeline(self) -> bool:
        """Whether this step ends with no microbatch in flight: the job's last step, or every step with
        ``pp_flush_per_step`` (the asynchronous pipeline otherwise carries its steady state into the next step)."""
        return self.spec.parallel.pp_flush_per_step or self.step + 1 >= self.spec.train.steps

    @staticmethod
    def _sync_grads(model, last: bool):
        """Reduce gradients only on the last accumulation microbatch."""
        if isinstance(model, DDP) and not last:
            return model.no_sync()
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def train_step(self, fault: dict | None = None) -> StepResult:
        """One optimizer step; returns the loss, the time per phase and memory for the controller.

        Phases: ``compute`` is time in forward/backward (for pipelines, the union of
        this rank's F/B/W chunks; gradient reduction overlapped with backward counts
        here), ``bubble`` the rest of the pipeline window (idle or waiting on a
        neighbour), ``communication`` the explicit collectives after backward
        (global grad norm, loss-scale agreement).
        """
        hook = StepFault(fault)
        if self.ps is not None and self.ps.asynchronous:
            return self.ps.run_round(hook)
        hook.before()
        self.fault = hook
        for stage in self.pipe_stages:
            stage.events.clear()
        self.compute_events.clear()
        self._begin_reducers()
        self.rewards = RewardTally(self.device) if self.dpo else None
        t0 = time.perf_counter()
        self._begin_moe_step()
        inputs, targets = self.state.cursor.next_batch()
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        self._count_targets(targets)
        t1 = time.perf_counter()
        meter = self._activation_meter()
        with self.comm or contextlib.nullcontext():  # metrics.comm_bytes: count this step's collectives
            with meter:
                loss = self._forward_backward(inputs, targets)
            t2 = time.perf_counter()
            for reducer in self.parts.reducers:
                reducer.finish()
            if self.async_pipe is not None:  # its updates ran between the microbatches
                loss, grad_norm, applied = loss, self.async_pipe.grad_norm(), True
            else:
                loss, grad_norm, applied = self._reduce_grads(loss)
            t3 = time.perf_counter()
            lr = self.state.schedulers[0].get_last_lr()[0]  # the rate this step trains at, before the schedule moves
            memory = self._optimizer_step(applied, meter)
            moe_figures = moe.end_step(self.parts.modules, self.dp_group) or None
            dpo_figures = self.rewards.figures(self.dp_group) if self.dpo else None
        t4 = time.perf_counter()
        slowed = hook.slow_down(t4 - t0)
        events = [e for stage in self.pipe_stages for e in stage.events]
        compute = busy_seconds(events) if events else t2 - t1
        times = StepTimes(data=t1 - t0, compute=compute + slowed, bubble=max(0.0, (t2 - t1) - compute),
                          communication=t3 - t2, optimizer=t4 - t3, step=t4 - t0 + slowed)
        eval_loss, eval_s = self._evaluate()
        return self.result(loss=None if loss is None else float(loss), grad_norm=grad_norm,
                           lr=lr, tokens=int(inputs.numel()), applied=applied,
                           time_s=times, memory=memory, timeline=self._timeline(events),
                           comm_bytes=self.comm_bytes(), moe=moe_figures, eval_loss=eval_loss, eval_s=eval_s,
                           dpo=dpo_figures)

    def _evaluate(self) -> tuple[float | None, float | None]:
        """The held-out loss and its seconds when this step is one ``eval.every`` names (after the update: the
        figure is the model's at this step), else (None, None)."""
        if self.evaluator is None or not self.spec.eval.due(self.step, self.spec.train.steps):
            return None, None
        return self.evaluator.run()

    def comm_bytes(self) -> dict[str, int] | None:
        """With ``metrics.comm_bytes``, this step's bytes per mesh dimension (``result`` adds the shards' ``ps``)."""
        return None if self.comm is None else self.comm.take()

    def _timeline(self, pipeline_events: list[dict]) -> list[dict] | None:
        """This step's events when the job records them: pipeline F/B/W (or, without a pipeline, each
        microbatch's forward+backward as ``FB``) and each gradient bucket's reduction (``allreduce``)."""
        comm = [e for reducer in self.parts.reducers for e in reducer.take_events()]
        if not self.spec.record_timeline:
            return None
        events = (pipeline_events or self.compute_events) + comm
        return [{"step": self.step, "rank": self.rank, "pp_rank": self.coords.pp, "stage": 0, **e} for e in events]

    def _begin_reducers(self) -> None:
        """Tell the gradient buckets the step (PowerSGD's warm-up counts it), and keep them silent while an
        optimizer averages over data parallelism itself (``onebit_adam`` after its warm-up: its compressed
        momentum is what crosses the group)."""
        for reducer, opt in zip(self.parts.reducers, self.state.optimizers):
            reducer.begin(self.step, paused=bool(getattr(opt, "communicates", False)))

    def _begin_moe_step(self) -> None:
        """Tell the MoE layers where this rank's sequences start in the data stream (their routing noise is
        drawn per sequence from it) and the main loss's gradient scale (their auxiliary losses use it: loss
        scale over the microbatches, as ``_microbatch_loss`` divides each microbatch's loss, pipelined or not).
        Under a loss mask too: the auxiliary losses are means over a microbatch's sequences, not sums over its
        counted targets, so ``counted_scale`` does not apply to them (``tests/integration/test_sft_parity.py``)."""
        scale = self.state.scaler.scale if self.state.scaler else 1.0
        moe.begin_step(self.parts.modules, self.spec.train.seed, self.state.cursor.start, scale / self.microbatches)

    def _reduce_grads(self, loss: torch.Tensor | None) -> tuple[torch.Tensor | None, float, bool]:
        """Unscale (fp16), then clip on the global norm or hand the gradients to the PS shards (which clip,
        step and send the new weights back). Returns the unscaled loss, the norm and whether to step."""
        applied = True
        if self.state.scaler is not None:
            scale = self.state.scaler.scale  # the forward's: the check moves it (halved on overflow, grown after
            applied = self.state.scaler.unscale_and_check(self.params)  # a run of good steps)
            if loss is not None:
                loss = loss / scale  # a skipped step's loss is recorded too, unscaled like any other
        for zero1 in self.zero1:
            zero1.reduce_scatter()
        if self.ps is not None:
            grad_norm = self.ps.sync() if applied else self.ps.skip()
        else:
            grad_norm = float("nan")
            if applied:
                grad_norm = clip_grads(self.stepped_params, self.spec.grad_clip, self.pp_group, self.expert_norm)
        return loss, grad_norm, applied

    def _optimizer_step(self, applied: bool, meter) -> dict | None:
        """Step, zero and schedule; returns model-state memory (measured while parameters, gradients and
        optimizer state all exist) when the step is metered, else None."""
        for opt in self.state.optimizers:
            if applied and self.ps is None and self.async_pipe is None:  # PipeDream stepped between microbatches
                opt.step()
        for zero1 in self.zero1:
            if applied:
                zero1.all_gather()
        memory = None
        if isinstance(meter, ActivationMeter):
            memory = {**model_state_bytes(self.parts.modules, self.state.optimizers), "activations": meter.peak,
                      "step_peak": meter.step_peak}
        for opt, sched in zip(self.state.optimizers, self.state.schedulers):
            if self.async_pipe is None:  # PipeDream zeroes after each update: a 2BW window may span steps
                opt.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                # torch warns of a skipped LR value when no update ran before the schedule's first step. Expected
                # twice: 2BW's first update on an early stage may come a step later (each update runs at its
                # step's LR, step_lrs), and an fp16 step that overflowed is skipped while its LR value passes, as
                # in PyTorch's own AMP recipe (GradScaler.step, then the scheduler's), so the schedule follows
                # the step count, which a resume and the records count by too.
                if self.async_pipe is not None or not applied:
                    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
                sched.step()
        for zero1 in self.zero1:
            zero1.zero_grad()
        self.state.step += 1
        return memory

    def result(self, **fields) -> StepResult:
        """The one producer of ``StepResult`` (the synchronous step here, asynchronous PS rounds in ``PSSync``):
        the step's own fields plus this rank's identity, step count and memory now."""
        if self.ps is not None:  # the shards' traffic: payload of this rank's pushes and pulls (messages, not
            traffic = self.ps.client.take_traffic()  # collectives), and the staleness of its reads
            fields["ps"] = traffic
            if fields.get("comm_bytes") is not None:
                fields["comm_bytes"] = {**fields["comm_bytes"], "ps": traffic["push"] + traffic["pull"]}
        return StepResult(rank=self.rank, step=self.step, peak_memory_bytes=self.peak_memory_bytes(),
                          current_memory_bytes=self.current_memory_bytes(), data_mix=self.data_mix(), **fields)

    def data_mix(self) -> dict[str, int] | None:
        """Under `data.mix`, the samples each source has supplied so far (the whole job's, from the stream position,
        so every rank reports the same): the run's records show the mix is the one asked for."""
        cursor = self.state.cursor
        return cursor.dataset.contributed(cursor.position) if isinstance(cursor.dataset, MixedDataset) else None

    def _activation_meter(self):
        """An ``ActivationMeter`` over this step when the job asks to measure memory, else a no-op."""
        if not self.spec.memory.measure:
            return contextlib.nullcontext()
        memory, fam = self.spec.memory, self.spec.model_family
        watched = [m for part in self.parts.modules
                   for m in checkpointed_modules(unwrap(part), memory.recompute, fam, memory.recompute_every)]
        return ActivationMeter(self.parts.modules, watched,
                               lambda: live_state_bytes(self.parts.modules, self.state.optimizers))

    @property
    def stepped_params(self) -> list[torch.Tensor]:
        """What the optimizers step, whose gradients the clip reads: the parameters, or under ZeRO-1 this rank's
        slices of them (holding the dp-reduced gradients)."""
        return [p for opt in self.state.optimizers for group in opt.param_groups for p in group["params"]]

    @property
    def step(self) -> int:
        return self.state.step

    def close_stores(self) -> None:
        """Remove this rank's offload files now (stores also clean up at process exit, which ``ray.kill`` skips)."""
        stores = [getattr(o, "store", None) for o in self.state.optimizers]
        stores += [self.activations.store, self.param_offload]
        for store in stores:
            if store is not None:
                store.close()

    def peak_memory_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        # VmHWM is this address space's high-water mark. ru_maxrss is not: across fork/vfork + exec Linux
        # carries the parent's peak into it, so a probe started from a 1.5 GB pytest reported 1.5 GB.
        # Never report a peak below current (the kernel updates the mark lazily).
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        return max(hwm, self.current_memory_bytes())

    def current_memory_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
