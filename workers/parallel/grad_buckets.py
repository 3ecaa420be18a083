"""ZeRO-0 data parallelism: gradients averaged in buckets while backward still runs.

Why our own and not DDP or ``replicate``: DDP cannot wrap tensor-parallel (DTensor) parameters, nor stages
that a pipeline schedule runs backward on once per microbatch (raymesh's ZeRO-1 check says why);
``replicate`` (FSDP2's DDP) accepts both but reduces everything in one all-reduce after the whole backward
and takes no communication hook. This takes DDP's design for that case: parameters grouped into buckets along
the family's blocks in backward order (a bucket closes at a block boundary once it holds ``bucket_mb``), a
post-accumulate-grad hook per parameter, and an asynchronous all-reduce per bucket as soon as backward has
produced every gradient in it (on the last microbatch), through DDP's communication-hook interface, so the
compression kinds of ``workers.parallel.grad_compression`` plug in. ``finish`` waits for them all before
clipping and the optimizer.

A bucket whose hooks did not all fire (split-backward pipeline schedules compute weight gradients outside
autograd's accumulation, so its hook never runs) is reduced in ``finish``: correct, just not overlapped.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from workers.parallel.grad_compression import chains, comm_hook

MIB = 1 << 20


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local shard, which every data-parallel peer holds alike)."""
    return t._local_tensor if isinstance(t, DTensor) else t


class Bucket:
    """A run of parameters reduced together; duck-types ``torch.distributed.GradBucket`` for the hooks."""

    def __init__(self, index: int, params: list[nn.Parameter]):
        self._index, self.params = index, params
        self.shapes = [local(p).shape for p in params]
        self.flat: torch.Tensor | None = None
        self.last = False

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self.flat

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self.flat = tensor

    def gradients(self) -> list[torch.Tensor]:
        """Views of the flat buffer, one per parameter (hooks that compress per matrix write through them)."""
        out, offset = [], 0
        for shape in self.shapes:
            n = shape.numel()
            out.append(self.flat[offset:offset + n].view(shape))
            offset += n
        return out

    def parameters(self) -> list[nn.Parameter]:
        return self.params

    def is_last(self) -> bool:
        return self.last


    def gather(self) -> None:
        """Copy this rank's gradients into a fresh flat buffer (zeros where a parameter got none).

        Shapes are the gradients' own: under tensor parallelism a gradient may still be a Partial DTensor
        (its local tensor full-size) while its parameter is sharded; every data-parallel peer holds the same
        placements, and averaging partial sums is still exact.
        """
        self.shapes = [local(p.grad).shape if p.grad is not None else local(p).shape for p in self.params]
        with torch.no_grad():
            self.flat = torch.cat([local(p.grad).reshape(-1) if p.grad is not None
                                   else torch.zeros(s.numel(), dtype=p.dtype, device=p.device)
                                   for p, s in zip(self.params, self.shapes)])

    def scatter(self, averaged: torch.Tensor) -> None:
        """Write the group's average back into each gradient."""
        self.flat = averaged
        with torch.no_grad():
            for p, view in zip(self.params, self.gradients()):
                if p.grad is not None:
                    local(p.grad).copy_(view)


def plan_buckets(module: nn.Module, blocks: list[nn.Module], cap_bytes: float,
                 skip: frozenset[int] = frozenset()) -> list[list[nn.Parameter]]:
    """Trainable parameters (but those whose id is in ``skip``: reduced elsewhere) in backward order (reverse of
    registration), cut into buckets at unit boundaries (a block, or one parameter outside every block) once a
    bucket holds ``cap_bytes``."""
    owner = {id(p): i for i, b in enumerate(blocks) for p in b.parameters()}
    buckets: list[list[nn.Parameter]] = [[]]
    size, unit = 0, None
    for p in reversed([p for p in module.parameters() if p.requires_grad and id(p) not in skip]):
        this = owner.get(id(p), ("own", id(p)))
        if this != unit and size >= cap_bytes and buckets[-1]:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += local(p).numel() * local(p).element_size()
        unit = this
    return [b for b in buckets if b]


class GradBuckets:
    """The bucketed gradient averager of one stage module over the data-parallel ``group``."""

    def __init__(self, module: nn.Module, blocks: list[nn.Module], group, microbatches: int,
                 bucket_mb: float = 25.0, compression: str = "none", powersgd_rank: int = 4,
                 topk_ratio: float = 0.01, skip: frozenset[int] = frozenset(), warmup_steps: int = 0):
        cap = float("inf") if bucket_mb == 0 else bucket_mb * MIB  # 0: one bucket, reduced once backward is done
        self.buckets = [Bucket(i, ps) for i, ps in enumerate(plan_buckets(module, blocks, cap, skip))]
        self.buckets[-1].last = True
        self._hook_args = (compression, powersgd_rank, topk_ratio)
        self.warmup_steps = warmup_steps
        self.expected = [len(b.params) * microbatches for b in self.buckets]
        self.paused = False  # set by an optimizer that communicates itself (onebit_adam after warm-up)
        self.events: list[dict] = []  # this step's bucket reductions (start, end), for the timeline
        self._of = {id(p): b.index() for b in self.buckets for p in b.params}
        self.rebind(group)  # the hooks over ``group``, nothing launched yet
        for p in (p for b in self.buckets for p in b.params):
            p.register_post_accumulate_grad_hook(self._on_grad)

    def rebind(self, group) -> None:
        """Reduce over ``group`` from now on, dropping whatever a failed step left launched on the old one.

        Why: under ``recovery: keep_training`` a surviving rank keeps its model and this averager (its hooks stay
        on the parameters) while only the process group is re-formed around it. Only hooks that hold nothing but
        the group are rebound; PowerSGD's and top-k's error feedback would belong to the old group's replicas
        (``keep_training`` refuses them)."""
        compression, powersgd_rank, topk_ratio = self._hook_args
        if compression in ("powersgd", "topk") and hasattr(self, "state"):
            raise ValueError(f"parallel.grad_compression {compression!r} keeps error feedback per group: its "
                             "averager cannot move to another group; rebuild the rank instead")
        self.state, self.hook = comm_hook(compression, group, powersgd_rank, topk_ratio)  # the job's
        self.plain = comm_hook("none", group)  # (state, hook) of PowerSGD's warm-up steps
        self.active = (self.state, self.hook)  # this step's (state, hook), picked by ``begin``
        self.events = []
        for bucket in self.buckets:
            bucket.flat = None
        self._reset()

    def begin(self, step: int, paused: bool = False) -> None:
        """Before step ``step`` (0-based, the run's global count, so a resumed run's warm-up ends where the
        uninterrupted run's did): the first ``warmup_steps`` steps average plainly, overlapping backward, as
        PyTorch's PowerSGD hook does before ``start_powerSGD_iter``; the compressed hook, its error feedback
        starting at zero, takes over after them. ``paused``: an optimizer averages over data parallelism itself
        (``onebit_adam`` after its warm-up), so the buckets stay silent."""
        self.paused = paused
        self.active = self.plain if step < self.warmup_steps else (self.state, self.hook)

    @property
    def overlaps(self) -> bool:
        """Whether this step's hook is launched from backward (one collective per bucket) or after it."""
        return not chains(self.active[1])

    def _reset(self) -> None:
        self._fired = [0] * len(self.buckets)
        self._futures: dict[int, torch.futures.Future] = {}

    def _on_grad(self, param: nn.Parameter) -> None:
        """Count one accumulation; launch the bucket once every parameter got its last microbatch's."""
        if self.paused:
            return
        i = self._of[id(param)]
        if i in self._futures:
            raise RuntimeError(f"gradient bucket {i} got a gradient after its reduction started: more backward "
                               "passes ran than train.microbatches")
        self._fired[i] += 1
        if self.overlaps and self._fired[i] == self.expected[i]:
            self._launch(self.buckets[i])

    def _launch(self, bucket: Bucket) -> None:
        bucket.gather()
        flat = bucket.flat
        event = {"kind": "allreduce", "bucket": bucket.index(), "bytes": flat.numel() * flat.element_size(),
                 "start": time.time()}
        self.events.append(event)
        state, hook = self.active
        fut = hook(state, bucket)
        self._futures[bucket.index()] = fut.then(lambda f: _ended(event, f))

    def finish(self) -> None:
        """Reduce the buckets backward did not launch, wait for every one and write the averages back."""
        if not self.paused:
            for bucket in self.buckets:
                if bucket.index() not in self._futures:
                    self._launch(bucket)
                    if not self.overlaps:
                        self._futures[bucket.index()].wait()
            for bucket in self.buckets:
                bucket.scatter(self._futures[bucket.index()].wait())
                bucket.flat = None  # the flat copies live only from launch to here
        self._reset()

    def take_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events


def _ended(event: dict, fut: torch.futures.Future) -> torch.Tensor:
    """Future callback: stamp the reduction's end (on the backend's thread, as it completes)."""
    event["end"] = time.time()
    return fut.value()
