"""How a gradient bucket crosses the data-parallel group: ``parallel.grad_compression``.

Each kind is a communication hook with DDP's signature, ``hook(state, bucket) -> Future`` whose value is the
bucket's flat buffer holding the *average* over the group, so ``workers.parallel.grad_buckets`` drives them
all alike:

| kind | hook | on the wire |
|---|---|---|
| none | PyTorch's ``allreduce_hook`` | fp32 all-reduce |
| bf16, fp16 | PyTorch's ``bf16_compress_hook`` / ``fp16_compress_hook`` | the buffer cast to 16 bits |
| powersgd | ours, ``PowerSGD`` (Vogels et al. 2019, with error feedback) | rank-r factors P and Q |
| topk | ours, ``TopK`` (with error feedback) | the largest ``topk_ratio`` of entries, values + indices |

Why PowerSGD is our own: PyTorch's ``powerSGD_hook`` issues its second and third all-reduce from future
callbacks, which run on the communication backend's thread. Two ranks may then enqueue them in a different
order than the next bucket's all-reduce (gloo pairs collectives by order, so the buffers would mismatch),
and the byte counter (``workers.diagnostics.comm_bytes``), which watches the step's thread, would miss them.
Ours runs its three all-reduces in order on the calling thread. Top-k has no PyTorch hook.

PowerSGD's first ``parallel.powersgd_warmup_steps`` steps use the plain all-reduce hook instead
(``GradBuckets.begin`` picks the hook per step, as PyTorch's ``start_powerSGD_iter`` does).

Hooks whose ``chains`` attribute is true issue several collectives per bucket; the bucketer runs those
after backward, one bucket at a time, for the ordering reason above.

``WireCodec`` is the parameter-server counterpart (``parameter_server.compression``: bf16 or top-k messages to
the shards instead of collectives), sharing top-k's selection (``topk_with_feedback``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from workers.contract.compression_kinds import KINDS, PS_KINDS


def completed(value: torch.Tensor) -> torch.futures.Future:
    """A future already holding ``value`` (what a synchronous hook returns)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class ErrorFeedback:
    """Per-bucket error feedback (``errors``) as a ``state_dict`` of CPU copies, for snapshots and checkpoints
    (``workers.state.compression_feedback``); 1-bit Adam's, per parameter name, is ``onebit_adam.ParameterErrors``."""

    def __init__(self):
        self.errors: dict[int, torch.Tensor] = {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"error.{k}": e.detach().to("cpu", copy=True) for k, e in self.errors.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> None:
        self.errors = _per_bucket(state, "error", device)


class PowerSGD(ErrorFeedback):
    """Rank-``rank`` PowerSGD per gradient matrix, with error feedback and warm-started Q.

    Per matrix M (the gradient plus this rank's last error): P = M Q, all-reduce P, orthonormalise,
    Q = Mᵀ P, all-reduce Q; the average is approximated by P Qᵀ / N and the error M − P Qᵀ / N is kept for
    the next step. Tensors that would not shrink (vectors, or (n + m)·r ≥ n·m) are all-reduced whole.
    """

    chains = True

    def __init__(self, group, rank: int, seed: int = 0):
        self.group, self.rank = group, rank
        self.errors: dict[int, torch.Tensor] = {}
        self.qs: dict[int, torch.Tensor] = {}
        self.generator = torch.Generator().manual_seed(seed)  # same on every rank: Q starts identical

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Error feedback and warm-started Q per bucket, and the generator new Qs come from (CPU copies)."""
        qs = {f"q.{k}": q.detach().to("cpu", copy=True) for k, q in self.qs.items()}
        return {**super().state_dict(), **qs, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> None:
        super().load_state_dict(state, device)
        self.qs = _per_bucket(state, "q", device)
        if "generator" in state:
            self.generator.set_state(state["generator"])

    def compressible(self, t: torch.Tensor) -> bool:
        n, m = t.shape[0], t.numel() // max(1, t.shape[0])
        return t.dim() >= 2 and (n + m) * self.rank < n * m

    def __call__(self, _state, bucket) -> torch.futures.Future:
        buffer, world = bucket.buffer(), self.group.size()
        key = bucket.index()
        if key in self.errors:
            buffer.add_(self.errors[key])
        before = buffer.clone()
        grads = bucket.gradients()
        matrices = [g.view(g.shape[0], -1) for g in grads if self.compressible(g)]
        whole = [g for g in grads if not self.compressible(g)]
        if whole:
            flat = torch.cat([g.reshape(-1) for g in whole]).div_(world)
            dist.all_reduce(flat, group=self.group)
            for g, avg in zip(whole, _views(flat, [g.shape for g in whole])):
                g.copy_(avg)
        if matrices:
            self._approximate(key, matrices, world)
        self.errors[key] = before - buffer
        return completed(buffer)

    def _approximate(self, key: int, matrices: list[torch.Tensor], world: int) -> None:
        """Replace each matrix by its rank-r average approximation P Qᵀ / N (two all-reduces in all)."""
        ranks = [min(self.rank, *m.shape) for m in matrices]
        if key not in self.qs:
            self.qs[key] = torch.randn(sum(m.shape[1] * r for m, r in zip(matrices, ranks)),
                                       generator=self.generator).to(matrices[0])
        qs = _views(self.qs[key], [(m.shape[1], r) for m, r in zip(matrices, ranks)])
        ps = [m @ torch.linalg.qr(q).Q for m, q in zip(matrices, qs)]
        flat_p = torch.cat([p.reshape(-1) for p in ps])
        dist.all_reduce(flat_p, group=self.group)
        ps = [torch.linalg.qr(p).Q for p in _views(flat_p, [p.shape for p in ps])]
        for m, p, q in zip(matrices, ps, qs):
            q.copy_(m.t() @ p)
        dist.all_reduce(self.qs[key], group=self.group)
        for m, p, q in zip(matrices, ps, qs):
            m.copy_(p @ q.t()).div_(world)


class TopK(ErrorFeedback):
    """Keep the ``ratio`` largest-magnitude entries of the bucket (plus this rank's last error), all-gather
    (value, index) pairs, and sum them into the average; what was not sent is the next step's error."""

    chains = True

    def __init__(self, group, ratio: float):
        self.group, self.ratio = group, ratio
        self.errors: dict[int, torch.Tensor] = {}

    def __call__(self, _state, bucket) -> torch.futures.Future:
        buffer, world, key = bucket.buffer(), self.group.size(), bucket.index()
        indices, values, self.errors[key] = topk_with_feedback(buffer, self.ratio, self.errors.get(key))
        gathered_v = [torch.empty_like(values) for _ in range(world)]
        gathered_i = [torch.empty_like(indices, dtype=torch.int32) for _ in range(world)]
        dist.all_gather(gathered_v, values, group=self.group)
        dist.all_gather(gathered_i, indices.to(torch.int32), group=self.group)
        buffer.zero_()
        for v, i in zip(gathered_v, gathered_i):
            buffer.index_add_(0, i.long(), v)
        return completed(buffer.div_(world))


def topk_with_feedback(flat: torch.Tensor, ratio: float, error: torch.Tensor | None):
    """``(indices, values, error)``: the ``ratio`` largest-magnitude entries of ``flat`` plus the last ``error``
    (at least one), and what was left out, the next call's error. Adds ``error`` into ``flat`` in place.

    Shared by the all-reduce hook above and the parameter server's wire compression
    (``parameter_server.compression``)."""
    if error is not None:
        flat.add_(error)
    k = max(1, int(flat.numel() * ratio))
    indices = flat.abs().topk(k, sorted=False).indices
    left = flat.clone()
    left[indices] = 0
    return indices, flat[indices], left


class WireCodec:
    """``parameter_server.compression`` on a worker: encodes each push to the shards, says which dtype pulls
    come in (the shard casts; ``parameter_server/compression.py`` is the shards' side), keeps top-k's error
    feedback per chunk key. Here, not in ``parameter_server/``, because the error is the worker's state and the
    selection is the all-reduce hook's."""

    def __init__(self, kind: str = "none", topk_ratio: float = 0.01):
        if kind not in PS_KINDS:
            raise ValueError(f"parameter_server.compression {kind!r} is not one of {', '.join(PS_KINDS)}")
        self.kind, self.ratio = kind, topk_ratio
        self.errors: dict[str, torch.Tensor] = {}
        self.pull_dtype = "bfloat16" if kind == "bf16" else ""  # what a pull asks for

    def encode(self, chunks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The messages for one push of ``chunks`` (flat gradient chunks by key)."""
        if self.kind == "bf16":
            return {k: c.to(torch.bfloat16) for k, c in chunks.items()}
        if self.kind == "topk":
            return {k: self._topk(k, c) for k, c in chunks.items()}
        return chunks

    def _topk(self, key: str, chunk: torch.Tensor) -> torch.Tensor:
        flat = chunk.detach().reshape(-1).clone()
        indices, values, self.errors[key] = topk_with_feedback(flat, self.ratio, self.errors.get(key))
        return torch.sparse_coo_tensor(indices.unsqueeze(0), values, flat.shape, check_invariants=False).coalesce()


def _per_bucket(state: dict[str, torch.Tensor], kind: str, device) -> dict[int, torch.Tensor]:
    """``{bucket: tensor}`` of the ``kind.<bucket>`` entries of a hook's ``state_dict``, copied to ``device``."""
    return {int(k.split(".", 1)[1]): t.to(device, copy=True) for k, t in state.items() if k.startswith(kind + ".")}


def _views(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    """Consecutive views of ``flat`` with the given shapes."""
    out, offset = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        out.append(flat[offset:offset + n].view(shape))
        offset += n
    return out


def comm_hook(kind: str, group, powersgd_rank: int = 4, topk_ratio: float = 0.01):
    """``(state, hook)`` for ``kind``: DDP's hook pair, the state being what the hook's first argument gets."""
    if kind == "none":
        return group, default_hooks.allreduce_hook
    if kind == "bf16":
        return group, default_hooks.bf16_compress_hook
    if kind == "fp16":
        return group, default_hooks.fp16_compress_hook
    if kind == "powersgd":
        return None, PowerSGD(group, powersgd_rank)
    if kind == "topk":
        return None, TopK(group, topk_ratio)
    raise ValueError(f"parallel.grad_compression {kind!r} is not one of {', '.join(KINDS)}")


def chains(hook) -> bool:
    """Whether ``hook`` issues several collectives per bucket (see the module docstring)."""
    target = hook.func if isinstance(hook, functools.partial) else hook
    return bool(getattr(target, "chains", False))
