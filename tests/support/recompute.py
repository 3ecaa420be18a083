"""Measured vs predicted bytes saved for backward by one process's tiny GPT under a recompute setting
(``memory.recompute`` with ``recompute_every``, or ``sqrt``): the shared arithmetic of the recompute tests."""

from __future__ import annotations

import torch

from orchestrator.planning.estimate import head_bytes, layer_bytes
from workers.diagnostics.memory_probe import ActivationMeter
from workers.model.gpt import GPT, lm_loss
from workers.model.registry import family, model_config
from workers.parallel.recompute import apply_recompute, checkpointed_modules


def measured_saved_bytes(spec) -> int:
    """Peak bytes saved for backward in one forward of the job's model, as its ranks build it."""
    torch.manual_seed(0)
    worker = spec.worker_dict()  # what the ranks run (memory.recompute: sqrt arrives with its segment length)
    gpt = GPT(model_config(worker["model"]))
    policy, every = worker["memory"]["recompute"], worker["memory"]["recompute_every"]
    apply_recompute(gpt, policy, family("gpt"), every)
    watched = checkpointed_modules(gpt, policy, family("gpt"), every)
    tokens = torch.randint(0, spec.model.vocab_size, (spec.train.global_batch_size, spec.model.seq_len))
    with ActivationMeter([gpt], watched) as meter:
        loss = lm_loss(gpt(tokens), tokens)
    loss.backward()
    return meter.peak


def predicted_saved_bytes(spec) -> int:
    """What the memory model says the same forward saves (every block plus the head)."""
    return sum(layer_bytes(spec, i) for i in range(spec.model.n_layers)) + head_bytes(spec)
