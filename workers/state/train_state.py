"""``TrainState``: everything a rank must keep to resume training exactly, defined once.

Model parts, their optimizers and LR schedulers, the data cursor, the fp16 loss
scaler and the step count. DCP checkpoints (``checkpoint_io``), in-memory
snapshots (``snapshot``) and the parameter-server path all read and write the
rank's state through this one object, so a new piece of state (another
scheduler, an RNG) is added here and every path carries it.

``state_dict()``/``load_state_dict()`` follow DCP's ``Stateful`` protocol with
the layout checkpoints have always had on disk: ``model`` and ``optim`` keyed
by global parameter names (so DCP reshards across layouts) and ``train`` for
the progress.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from workers.model.names import unwrap
from workers.state import expert_stacks

# flattened optimizer keys (``state.<fqn>.exp_avg``) merge across stage parts, and each part
# takes only its own keys back
_OPTIONS = StateDictOptions(strict=False, flatten_optimizer_state_dict=True)


def replica_prefix(replica: int) -> str:
    """The name a replica's own entries (weights, inner optimizer state) carry in a checkpoint: DCP keeps one copy
    of a key every rank saves, and under diloco each replica's are its own (``TrainState._own``)."""
    return f"diloco_replica{replica}"


class TrainState:
    """One rank's training state: model parts, optimizers, schedulers, data cursor, loss scaler, step.

    ``param_offload`` (or None) is the store that holds offloaded parameter shards; ``resident`` brings
    them back to the device around a read or write of the state. ``optim_modules`` name, per part, what its
    optimizer steps: the part itself (the default), or under ZeRO-1 this rank's slices of its parameters
    (``DistributedOptimizer.module``), saved under the same names. ``expert_mesh`` (expert parallelism's
    ``edp × ep × pp × tp`` mesh, None at ep=1) places this rank's experts in their full stacks for checkpoints.
    """

    def __init__(self, modules: list[nn.Module], optimizers: list, schedulers: list, cursor,
                 scaler=None, param_offload=None, optim_modules: list[nn.Module] | None = None,
                 expert_mesh=None):
        self.modules = modules
        self.optim_modules = optim_modules or [unwrap(m) for m in modules]
        self.optimizers = optimizers
        self.schedulers = schedulers
        self.cursor = cursor
        self.scaler = scaler
        self.param_offload = param_offload
        self.step = 0
        # an asynchronous pipeline's state at a step boundary (stashed weight versions, microbatches in flight):
        # an object with state_dict() and load_state_dict(state, step), set by the trainer (else None)
        self.weight_versions = None
        # a rank's compression state outside the optimizer: parameter-server top-k's error feedback (``PSSync``) or
        # ZeRO-0 compression's (``CompressionFeedback``); state_dict() and load_state_dict(), or None
        self.wire_feedback = None
        self.experts = expert_stacks.sharded_experts(unwrap(m) for m in modules)  # empty unless ep > 1
        self.expert_mesh = expert_mesh
        # dp_sync diloco (workers/step/diloco.py): theta_outer and the outer momentum (state_dict() and
        # load_state_dict(), host_copy()), and this replica's name, under which its own weights and inner optimizer
        # state are saved (they differ between replicas mid-round); None without diloco
        self.outer = None
        self.replica: str | None = None
        # ZeRO-1 with a lossy parameter gather (parallel.param_gather_dtype): the stepped slices are exact fp32
        # masters apart from the dequantized parameters; saves take the masters, and after a load ``refresh``
        # (the sliced optimizers' all-gathers, set by the trainer) rebuilds the parameters from them
        self.refresh: list = []

    def resident(self, write_back: bool = True):
        """Offloaded parameter shards back on the device for the block; ``write_back`` False where the block
        only reads them (saves, snapshots), so nothing is written to the store."""
        return self.param_offload.resident(write_back) if self.param_offload else contextlib.nullcontext()

    def named_parts(self) -> Iterator[tuple[Iterator[tuple[str, nn.Parameter]], Iterator, Any]]:
        """Per model part: its named parameters (global names), the named tensors its optimizer steps (the same,
        or their ZeRO-1 slices) and that optimizer, its state whole: a paged optimizer's (``memory.offload.page_at``,
        workers/offload/paged.py) is fetched back first, so a snapshot neither misses it nor is overwritten by it."""
        for part, named, opt in zip(self.modules, self.optim_modules, self.optimizers):
            pager = getattr(opt, "pager", None)
            if pager is not None:
                pager.page_in()
            yield unwrap(part).named_parameters(), named.named_parameters(), opt

    # -- progress: what resumes the run beyond weights and optimizer state ---------------------------------

    def progress_state(self) -> dict:
        state = {"step": self.step, "data": self.cursor.state_dict(), "lr_scheduler": self.schedulers[0].state_dict()}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_progress_state(self, state: dict) -> None:
        self.step = int(state["step"])
        self.cursor.load_state_dict(state["data"])
        for opt, sched in zip(self.optimizers, self.schedulers):
            sched.load_state_dict(_rescheduled(state["lr_scheduler"], sched))
            for group, lr in zip(opt.param_groups, sched.get_last_lr()):
                group["lr"] = lr  # the scheduler's state does not carry the optimizer's current lr
        if self.scaler is not None:
            self.scaler.load_state_dict(state["loss_scaler"])

    # -- DCP Stateful --------------------------------------------------------------------------------------

    def _model_and_optim(self) -> tuple[dict, dict]:
        model, optim = {}, {}
        for part, named, opt in zip(self.modules, self.optim_modules, self.optimizers):
            model.update(plain_shards(get_model_state_dict(unwrap(part))))  # ZeRO-2/3's quantized gathers
            if self.masters_apart:  # the exact fp32 masters under the parameters' names, not the rounded values
                model.update(get_model_state_dict(named))
            optim.update(get_optimizer_state_dict(named, opt, options=_OPTIONS))
        return model, optim

    def state_dict(self) -> dict:
        """Model and optimizer state keyed by global names, plus progress (call inside ``resident``); experts
        split over ep ranks are handed to DCP as their full stacks (``workers.state.expert_stacks``), so any ep reads
        them."""
        model, optim = self._model_and_optim()
        if self.experts:
            model = expert_stacks.whole(model, self.experts, self.expert_mesh)
            optim = expert_stacks.whole(optim, self.experts, self.expert_mesh)
        out = {"model": self._own(model), "optim": self._own(optim), "train": self.progress_state()}
        if self.outer is not None:
            out["diloco"] = self.outer.state_dict()
        if self.weight_versions is not None:
            out["weight_versions"] = self.weight_versions.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        """Each part takes its own keys of ``state`` back (call inside ``resident``). The optimizer's state (moments,
        step counts) comes from ``state``, its hyperparameters (weight decay, betas, momentum, the rate) stay the job
        file's: a resume with ``--set optim.lr=...`` must train at that rate, not at the checkpoint's."""
        model, optim = self._shared(state["model"]), self._shared(state["optim"])
        if self.experts:
            like_model, like_optim = self._model_and_optim()
            model = expert_stacks.held(model, like_model, self.experts)
            optim = expert_stacks.held(optim, like_optim, self.experts)
        for part, named, opt in zip(self.modules, self.optim_modules, self.optimizers):
            set_model_state_dict(unwrap(part), self._load_masters(named, model), options=_OPTIONS)
            job_groups = _hyperparameters(opt)
            set_optimizer_state_dict(named, opt, optim, options=_OPTIONS)
            for group, job in zip(opt.param_groups, job_groups, strict=True):
                group.update(job)
        self.load_progress_state(state["train"])
        self.load_weight_versions(state.get("weight_versions", {}))
        if self.outer is not None:
            self.outer.load_state_dict(state["diloco"])
        for refresh in self.refresh:
            refresh()

    def _own(self, entries: dict) -> dict:
        """Under diloco each replica's entries under its own names (``replica``): DCP saves one copy of a key that
        every dp rank holds, and a replica's weights and moments are its own; as they are otherwise."""
        return entries if self.replica is None else {f"{self.replica}.{k}": v for k, v in entries.items()}

    def _shared(self, entries: dict) -> dict:
        """``_own``'s entries under the names the parts know again."""
        if self.replica is None:
            return entries
        head = f"{self.replica}."
        return {k[len(head):]: v for k, v in entries.items() if k.startswith(head)}

    @property
    def masters_apart(self) -> bool:
        return bool(self.refresh)

    def _load_masters(self, named: nn.Module, model: dict) -> dict:
        """With masters apart, load the saved values into the masters and hand the part only the rest (frozen
        weights, buffers): its trainable parameters are rebuilt from the masters by ``refresh``."""
        if not self.masters_apart:
            return model
        keys = set(get_model_state_dict(named))
        set_model_state_dict(named, {k: v for k, v in model.items() if k in keys}, options=_OPTIONS)
        return {k: v for k, v in model.items() if k not in keys}

    def load_weight_versions(self, versions: dict) -> None:
        """Hand the asynchronous pipeline its stashed versions back, with the step they belong to."""
        if self.weight_versions is not None:
            self.weight_versions.load_state_dict(versions, self.step)


def _hyperparameters(opt) -> list[dict]:
    """Each param group's settings as this job built them (everything but its parameters), to put back over those a
    checkpoint's param groups carry."""
    return [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]


def _rescheduled(saved: dict, sched) -> dict:
    """A saved LR schedule's position (``last_epoch``) under this job's base rate: the saved ``base_lrs`` and last
    rates are the run's that saved it, and a resume with another ``optim.lr`` must not train at those."""
    epoch = saved["last_epoch"]
    rates = [base * factor(epoch) for base, factor in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
    return {**saved, "base_lrs": list(sched.base_lrs), "_last_lr": rates}


def plain_shards(entries: dict) -> dict:
    """A model state dict whose FSDP2 shards are a gather subclass (ZeRO-2/3's quantized gathers,
    ``workers/parallel/fsdp_quantized_gather.py``, known here by its ``plain`` method so this layer does not import
    that one), with plain fp32 shards (the same storage): checkpoints save the masters as ordinary tensors, and a job
    without quantized gathers reads them."""
    return {k: _plain_dtensor(v) for k, v in entries.items()}


def _plain_dtensor(value):
    """``value`` (a DTensor whose local shard has ``plain``) over its plain shard, else unchanged."""
    local = getattr(value, "_local_tensor", None)
    if isinstance(value, DTensor) and callable(getattr(local, "plain", None)):
        return DTensor.from_local(local.plain(), value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return value
