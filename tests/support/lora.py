"""The base and LoRA models of one spec, built the way the worker builder and the reference build them."""

from __future__ import annotations

import torch

from orchestrator import JobSpec
from workers.finetune import prepare_model
from workers.model.gpt import GPT
from workers.model.registry import model_config


def base_and_lora(spec: JobSpec) -> tuple[GPT, GPT]:
    """(base model, LoRA model) from the same seed, as the builder and the reference build them."""
    cfg = model_config(spec.worker_dict()["model"])
    torch.manual_seed(spec.train.seed)
    base = GPT(cfg)
    torch.manual_seed(spec.train.seed)
    model = GPT(cfg)
    prepare_model(model, spec.model.lora, spec.train.seed)
    return base, model
