"""PipeDream's profiler: forward and backward time, saved activations and parameters of every pipeline unit.

The units are the ones a stage cut moves: the embedding (always on the first stage), each block, and the head
(final norm, output projection and loss: always on the last stage). ``parallel.pp_split: auto`` feeds these
costs to ``workers.parallel.partition.balanced_split``.

Why ours: ``torch.profiler`` reports operators, not which module's forward or backward they belonged to once
autograd runs them, and attributing saved tensors to a module needs ``saved_tensors_hooks`` anyway; module
hooks give both directly. Times are the fastest of ``steps`` measured steps after a warm-up step, on one
thread: interference from other processes only ever adds time, and a thread pool on a shared machine stalls
on its barriers (medians of three steps on a loaded 2-core machine were off by 100x). Backward
times come from when each block's output gradient arrives (``register_full_backward_pre_hook``): autograd
runs the head's backward, then each block's in reverse order, then the embedding's.

``profile_in_fresh_process`` is what ``parallel.pp_split: auto`` calls: the same profile in a new interpreter
whose allocator keeps freed memory (glibc's ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``). In the
caller's process a large tensor (the head's logits, its gradient) was often served by fresh pages from the
kernel, faulted in on first touch, and whether it was depended on that process's heap history: on a 6-block
model under an 8192-word head, six profiles in fresh processes put the head at 5.97-8.63 blocks, and ten in
one process at 5.15-9.23 (each the fastest of 5 steps); with memory kept they gave 5.23-5.84 and 5.47-5.98.
A training rank reuses its memory from step to step, as the kept allocator does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from workers.model.config import ModelConfig
from workers.model.gpt import model_loss
from workers.model.registry import build_model, model_config


@dataclass(frozen=True)
class UnitCost:
    """One unit's measured cost for one microbatch."""

    forward_s: float
    backward_s: float
    activation_bytes: int  # saved for backward (parameters excluded), each storage counted once
    params: int

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class ModelCosts:
    """The profile of a whole model: embedding, blocks in order, head."""

    embedding: UnitCost
    layers: tuple[UnitCost, ...]
    head: UnitCost

    def to_dict(self) -> dict:
        return {"embedding": asdict(self.embedding), "layers": [asdict(u) for u in self.layers],
                "head": asdict(self.head)}

    @classmethod
    def from_dict(cls, raw: dict) -> ModelCosts:
        """``to_dict`` read back (``profile_in_fresh_process``'s child sends its costs this way)."""
        return cls(UnitCost(**raw["embedding"]), tuple(UnitCost(**u) for u in raw["layers"]), UnitCost(**raw["head"]))


class _Recorder:
    """Hooks on the model's blocks that stamp times and attribute saved tensors to the unit running."""

    def __init__(self, model: nn.Module):
        self.blocks = list(model.layers.values())
        self.param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.unit = 0  # 0 embedding, 1..n blocks, n+1 head
        self.saved: list[dict[int, int]] = [{} for _ in range(len(self.blocks) + 2)]
        self.stamps: dict[str, float] = {}
        self.handles = []
        for i, block in enumerate(self.blocks):
            self.handles += [
                block.register_forward_pre_hook(self._enter(i)),
                block.register_forward_hook(self._leave(i)),
                block.register_full_backward_pre_hook(self._stamp(f"bwd{i}")),
            ]
        self.handles.append(self.blocks[0].register_full_backward_hook(self._stamp("bwd_end0")))

    def _enter(self, i: int):
        def hook(_module, _args):
            self.stamps[f"fwd{i}"] = time.perf_counter()
            self.unit = i + 1
        return hook

    def _leave(self, i: int):
        def hook(_module, _args, _out):
            self.stamps[f"fwd_end{i}"] = time.perf_counter()
            self.unit = i + 2 if i == len(self.blocks) - 1 else i + 1
        return hook

    def _stamp(self, name: str):
        def hook(*_):
            self.stamps[name] = time.perf_counter()
        return hook

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.param_storages:
            self.saved[self.unit][storage.data_ptr()] = storage.nbytes()
        return tensor

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _one_step(model: nn.Module, rec: _Recorder, tokens: torch.Tensor, loss_fn) -> list[tuple[float, float]]:
    """One forward and backward; per unit (embedding, blocks, head) its (forward, backward) seconds."""
    n = len(rec.blocks)
    rec.unit, rec.saved = 0, [{} for _ in range(n + 2)]
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    s = rec.stamps
    fwd = [s["fwd0"] - t0] + [s[f"fwd_end{i}"] - s[f"fwd{i}"] for i in range(n)] + [t1 - s[f"fwd_end{n - 1}"]]
    bwd_blocks = [s["bwd_end0"] - s["bwd0"]] + [s[f"bwd{i - 1}"] - s[f"bwd{i}"] for i in range(1, n)]
    bwd = [t2 - s["bwd_end0"], *bwd_blocks, s[f"bwd{n - 1}"] - t1]
    return list(zip(fwd, bwd))


def _unit_params(model: nn.Module) -> list[int]:
    """Parameters of the embedding, each block and the head (everything else the root holds)."""
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.layers.values()]
    embedding = sum(m.weight.numel() for m in (model.tok_embeddings, getattr(model, "pos_embeddings", None)) if m)
    total = sum(p.numel() for p in model.parameters())
    return [embedding, *blocks, total - embedding - sum(blocks)]


def profile_model(cfg: ModelConfig, micro_batch: int, steps: int = 5, seed: int = 0,
                  loss_chunks: int = 1) -> ModelCosts:
    """Profile ``cfg``'s model on the CPU for one microbatch of ``micro_batch`` sequences of ``cfg.seq_len``
    random tokens: a warm-up step, then the fastest of ``steps`` steps per unit, on one thread. The head runs
    its loss as the job will (``train.loss_chunks``): chunked, it saves less and recomputes in backward."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    model.loss_chunks = loss_chunks

    def loss_fn(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return model_loss(model, out, targets)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1))
    rec, threads = _Recorder(model), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _one_step(model, rec, tokens, loss_fn)
        runs = [_one_step(model, rec, tokens, loss_fn) for _ in range(steps)]
    finally:
        rec.remove()
        torch.set_num_threads(threads)
    params = _unit_params(model)
    units = [UnitCost(min(r[u][0] for r in runs), min(r[u][1] for r in runs), sum(rec.saved[u].values()),
                      params[u]) for u in range(len(params))]
    return ModelCosts(units[0], tuple(units[1:-1]), units[-1])


# glibc reads these at start-up: serve every allocation from the heap and never hand its top back to the kernel,
# so a step reuses the pages the previous one faulted in (see the module docstring); other C libraries ignore them
KEEP_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def profile_in_fresh_process(model: dict, micro_batch: int, seed: int = 0, timeout_s: float = 600.0,
                             loss_chunks: int = 1) -> ModelCosts:
    """``profile_model`` of the model fields ``model`` run in a new interpreter that keeps its freed memory, so
    the profile neither depends on the caller's heap nor pays page faults a training rank does not."""
    env = {**os.environ, **KEEP_MEMORY, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # what the caller imports, the child does
    args = json.dumps({"model": model, "micro_batch": micro_batch, "seed": seed, "loss_chunks": loss_chunks})
    try:
        proc = subprocess.run([sys.executable, "-m", __name__, args], env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"profiling the model for parallel.pp_split: auto took longer than {timeout_s:g} s, "
                           "and was stopped") from None
    if proc.returncode != 0:
        raise RuntimeError(f"profiling the model for parallel.pp_split: auto failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}")
    return ModelCosts.from_dict(json.loads(proc.stdout.strip().splitlines()[-1]))


if __name__ == "__main__":  # profile_in_fresh_process's child: one JSON line of costs on stdout
    job = json.loads(sys.argv[1])
    print(json.dumps(profile_model(model_config(job["model"]), job["micro_batch"], seed=job["seed"],
                                   loss_chunks=job["loss_chunks"]).to_dict()))
