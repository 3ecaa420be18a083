"""The single-process reference every parallel layout is checked against.

Plain PyTorch on purpose: the model and data reader are shared with the
workers, but none of the parallel wrappers, trainer or optimizer plumbing is,
so a bug there cannot hide in both sides of a parity test.
"""

from __future__ import annotations

import torch

from orchestrator import JobSpec
from workers.data import DataCursor, TokenDataset
from workers.model import moe
from workers.model.config import model_config
from workers.model.finetune import prepare_model
from workers.model.gpt import lm_loss
from workers.model.hf_io import load_hf_weights
from workers.model.meta_init import build_full
from workers.optim.sm3 import SM3


def reference_run(spec: JobSpec, steps: int) -> tuple[list[float], list[float]]:
    """Per-step losses and pre-clip gradient norms."""
    torch.manual_seed(spec.train.seed)
    # the same per-parameter draw the ranks' meta-device build uses (workers.model.meta_init), whole
    model = build_full(model_config(spec.worker_dict()["model"]), spec.train.seed)
    if spec.model.init_from is not None:  # read whole here; the layouts read their slices
        load_hf_weights(model, spec.model.init_from)
    if spec.model.lora is not None:  # adapters and NF4 are model code, shared like GPT itself
        prepare_model(model, spec.worker_dict()["model"]["lora"], spec.train.seed)
    o = spec.optim
    if o.name == "sm3":  # our own optimizer: its sharded step is what a layout's parity checks
        opt = SM3(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    data = TokenDataset(spec.data.path, spec.model.seq_len, spec.data.seed)
    cursor = DataCursor(data, spec.train.global_batch_size, dp_rank=0, dp_size=1)
    losses, norms = [], []
    for _ in range(steps):
        moe.begin_step([model], spec.train.seed, cursor.start, aux_scale=1.0)  # MoE noise keyed by stream position
        inputs, targets = cursor.next_batch()
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)))
        opt.step()
        opt.zero_grad()
        moe.end_step([model], None)  # balancing biases move after the step, as on the ranks
        losses.append(loss.item())
    return losses, norms


def reference_losses(spec: JobSpec, steps: int) -> list[float]:
    return reference_run(spec, steps)[0]
