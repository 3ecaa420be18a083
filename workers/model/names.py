"""A parameter's name, the same under every layout: it keys checkpoints and seeds the parameter's initial values.

The builder wraps a model (DDP, FSDP2, activation checkpointing, ``torch.compile``) and each wrapper may add a hop
to the names ``named_parameters`` gives; checkpoints, the Hugging Face mapping and the per-parameter generators
need the name the single-process reference has. Kept beside the model, below the wrappers, so the model code,
the optimizers and the training state read names without importing the parallel wrappers.
"""

from __future__ import annotations

import hashlib
import re

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def unwrap(module: nn.Module) -> nn.Module:
    """The model under a DDP wrapper, so parameter names match every other layout."""
    return module.module if isinstance(module, DDP) else module


# wrappers the builder adds around a parameter's module (activation checkpointing, FSDP, compile): not its name
_WRAPPERS = re.compile(r"(_checkpoint_wrapped_module|_fsdp_wrapped_module|_orig_mod)\.")


def plain_name(name: str) -> str:
    """``name`` without the wrapper hops, as DCP's state dicts key it, so it is the same under every recompute,
    compile and ZeRO setting (``unwrap`` takes DDP's ``module.`` away before a name is read)."""
    return _WRAPPERS.sub("", name)


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded from (job seed, parameter name): the same on every rank and layout."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def mapped_name(name: str, ends: dict[str, str], layer: dict[str, str], family: str) -> str:
    """The Hugging Face name of raymesh tensor ``name`` in a family with its own table: ``ends`` (embedding, norm,
    head) by whole name, a block's tensors ``layers.{i}.<rest>`` by ``layer[rest]`` under ``model.layers.{i}.``;
    another name is a KeyError naming ``family``."""
    if name in ends:
        return ends[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in layer:
        raise KeyError(f"{name!r} has no Hugging Face {family} counterpart")
    return f"model.layers.{m.group(1)}.{layer[m.group(2)]}"
