"""Sharded save and load of one rank's training state with DCP.

Model and optimizer state are keyed by global parameter names (layers keep
their global index on every pipeline stage), and DCP reshards on load, so a
checkpoint written at one layout loads at another. The data position and step
travel with it, so a resumed run continues with exactly the unseen samples.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

from workers.parallel.data_parallel import unwrap

# flattened optimizer keys (``state.<fqn>.exp_avg``) merge across stage parts, and each part
# takes only its own keys back
_OPTIONS = StateDictOptions(strict=False, flatten_optimizer_state_dict=True)


def local_optimizer(opt):
    """ZeRO-1 keeps this rank's partition in a plain inner optimizer; DCP saves that partition."""
    return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt


class CheckpointIO:
    def __init__(self, trainer):
        self.trainer = trainer
        self.pending: Future | None = None
        self.pending_step: int | None = None
        # async saves run their collectives on their own group so they never interleave with training's
        self.group = dist.new_group(backend="gloo")

    def _state(self) -> dict:
        t = self.trainer
        model, optim = {}, {}
        for part, opt in zip(t.parts.modules, t.optimizers):
            model.update(get_model_state_dict(unwrap(part)))
            optim.update(get_optimizer_state_dict(unwrap(part), local_optimizer(opt), options=_OPTIONS))
        return {"model": model, "optim": optim, "train": t.progress_state()}

    def save(self, path: str | Path, async_save: bool) -> None:
        self.wait()
        with self.trainer.resident_params(write_back=False):  # async_save stages its copy before returning
            state = self._state()
            if async_save:
                self.pending = dcp.async_save(state, checkpoint_id=str(path), process_group=self.group)
                self.pending_step = self.trainer.step
            else:
                dcp.save(state, checkpoint_id=str(path), process_group=self.group)

    def wait(self) -> int | None:
        """Block until an in-flight async save is durable; return its step."""
        if self.pending is None:
            return None
        self.pending.result()
        step, self.pending, self.pending_step = self.pending_step, None, None
        return step

    def load(self, path: str | Path) -> None:
        t = self.trainer
        with t.resident_params():
            state = self._state()
            dcp.load(state, checkpoint_id=str(path), process_group=self.group)
            for part, opt in zip(t.parts.modules, t.optimizers):
                set_model_state_dict(unwrap(part), state["model"], options=_OPTIONS)
                set_optimizer_state_dict(unwrap(part), local_optimizer(opt), state["optim"], options=_OPTIONS)
        t.load_progress_state(state["train"])
