"""Pipeline parallelism with ``torch.distributed.pipelining``.

We split the model ourselves (whole blocks per stage, keeping global layer
names; the family's ``cut_stage`` hook does the cutting, ``workers.parallel.layout``
says which layers a stage and which stages a rank owns) and hand the stages to
PyTorch's schedules.
"""

from __future__ import annotations

import time

import torch
import torch.distributed.pipelining as pipelining
from torch import nn
from torch.distributed.pipelining import PipelineStage

from workers.contract.schedules import schedule as schedule_facts
from workers.model import moe
from workers.model.documents import Documents, attending


class TimedStage(PipelineStage):
    """A ``PipelineStage`` that records when each forward, backward and weight-gradient chunk ran.

    The events give the per-rank busy time (hence the measured bubble) and the
    timeline that ``raymesh report`` draws; wall-clock ``time.time()`` so ranks
    in different processes line up.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events: list[dict] = []
        self.moe_layers = moe.pipeline_layers(self.submod)  # told each chunk's microbatch index
        # model.attention_mask: document: each microbatch's document ids, set by the trainer for the step
        self.documents: list[Documents | None] = []

    def _timed(self, kind: str, run, chunk: int, *args, **kwargs):
        """Run one chunk's forward, backward or weight pass, its microbatch's MoE index and documents set (a
        backward may replay the forward under recompute), and record when it ran."""
        start = time.time()
        documents = self.documents[chunk] if self.documents else None
        with moe.running_microbatch(self.moe_layers, chunk), attending([self.submod], documents):
            out = run(chunk, *args, **kwargs)
        self.events.append({"stage": self.stage_index, "microbatch": chunk, "kind": kind,
                            "start": start, "end": time.time()})
        return out

    def _get_init_p2p_neighbors_ops(self):
        """The warm-up sends and receives that open the links to the neighbouring stages, less those to this rank
        itself: a V-shaped schedule (zbv, dualpipev) puts two neighbouring stages on one rank, and gloo has no
        link to itself. torch 2.11 queues them anyway and gloo fails the pair; 2.13 rarely calls this at all."""
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        return self._timed("F", super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return self._timed("B", super().backward_one_chunk, bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return self._timed("W", super().backward_weight_one_chunk, bwd_chunk_id, *args, **kwargs)


def build_schedule(
    stages: list[nn.Module],
    ids: list[int],
    n_stages: int,
    schedule: str,
    n_microbatches: int,
    loss_fn,
    device: torch.device,
    group,
) -> tuple[object, list[TimedStage]]:
    """Wrap this rank's stage modules in ``TimedStage`` objects and the chosen schedule.

    ``loss_fn`` must already divide by ``n_microbatches`` (``scale_grads=False``): the schedules would otherwise
    divide the summed gradients after a stage's last backward, when ZeRO-0's buckets
    (``workers.parallel.grad_buckets``) have already taken them for averaging during that backward.
    """
    pipe_stages = [TimedStage(mod, sid, n_stages, device, group=group) for mod, sid in zip(stages, ids)]
    facts = schedule_facts(schedule)
    cls = getattr(pipelining, facts.torch_class)
    first = pipe_stages[0] if facts.single_stage else pipe_stages
    return cls(first, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False), pipe_stages
