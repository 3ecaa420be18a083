"""The held-out loss (``eval:``): this rank's share of the model scored with gradients off, after a step.

Every evaluation scores the same sequences: the first ``eval.batches`` x ``train.global_batch_size`` of the
held-out directory in its order for ``data.seed``, so the figures of one run, of two layouts and of a resumed run
line up. As in training, data-parallel rank ``d`` takes its slice of each batch and context-parallel ranks their
cp share of each sequence; each slice is cut into ``train.microbatches`` (a pipeline's microbatch size, and a
plain step's accumulation chunk), so no evaluation needs more activation memory than a training step.

Without a pipeline each microbatch goes through the model part. With one, ``PipelineSweep`` passes a batch's
microbatches stage by stage, pipelined: our own forward-only pass over the pp group, because PyTorch's
``schedule.eval()`` re-initialises every stage's buffers on each switch between evaluation and training on torch
2.13 and differs there from torch 2.11's, whose schedules keep training's; a sweep in stage order is the same on
every torch and every schedule (one or several stages per rank, loop or V placement), and an evaluation has no
backward to interleave.

The model is put in eval mode for the pass (dropout off, MoE routers without noise), each module's mode is
restored after it, and it draws nothing from the global random generator, so a run with evaluations trains
bit for bit as one without. The loss is the mean next-token cross entropy over this rank's tokens; the
controller averages the last-stage ranks' figures as it does the training loss (every share holds as many
tokens, and tensor-parallel peers hold the same figure). Data with a loss mask is scored as training scores it:
the sum of cross entropy over the counted targets of the whole evaluation set over their count (read once by every
rank, with the batches), each rank's figure its share times the dp x cp ranks the controller averages over.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from workers.data import TokenDataset
from workers.data.loader import IGNORE_INDEX, document_eos, document_ids
from workers.model.documents import Documents, attending, split_documents
from workers.model.gpt import model_loss
from workers.parallel.context_layout import split_sequence

# dtypes an activation may cross a stage boundary in, by the code the sweep's header carries
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # int64 slots: [dtype code, ndim, dims...]


class EvalData:
    """This rank's slices of the held-out batches: ``batches`` x (inputs, targets, document ids), read once and
    kept (the same sequences are scored at every evaluation; a rank holds ``batches`` x its slice, at most a few
    MiB). Document ids (whole windows, before the cp split) only under ``attention_mask: document``, else None."""

    def __init__(self, path: str, seq_len: int, seed: int, batches: int, global_batch: int, dp_rank: int,
                 dp_size: int, cp_rank: int = 0, cp_size: int = 1, attention_mask: str = "causal"):
        self.path, self.seq_len, self.seed, self.batches = path, seq_len, seed, batches
        self.per_rank, self.dp_size = global_batch // dp_size, dp_size
        self.counted: int | None = None  # under a loss mask, the whole set's count of counted targets
        self.global_batch, self.dp_rank = global_batch, dp_rank
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.attention_mask = attention_mask
        self._batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] | None = None

    def __iter__(self):
        if self._batches is None:
            dataset = TokenDataset(self.path, self.seq_len, self.seed)
            eos = document_eos(self.attention_mask, dataset)
            self._batches = [self._slice(dataset, b, eos) for b in range(self.batches)]
            if dataset.loss_mask:
                self.counted = int((dataset.batch(0, self.batches * self.global_batch)[1] != IGNORE_INDEX).sum())
        return iter(self._batches)

    @property
    def shares(self) -> int:
        """The ranks whose figures the controller averages and which hold other targets: dp x cp."""
        return self.dp_size * self.cp_size

    def _slice(self, dataset: TokenDataset, b: int, eos: int | None):
        inputs, targets = dataset.batch(b * self.global_batch + self.dp_rank * self.per_rank, self.per_rank)
        return (split_sequence(inputs, self.cp_size, self.cp_rank).contiguous(),
                split_sequence(targets, self.cp_size, self.cp_rank).contiguous(),
                None if eos is None else document_ids(inputs, eos))


class PipelineSweep:
    """A batch's microbatches forward through every pipeline stage, over the pp group, as a pipeline.

    Stage ``s`` lives on pp rank ``owner[s]``. Every rank walks the (stage, microbatch) pairs it owns in that
    order: the first stage takes the tokens, a later one the activation the owner of ``s - 1`` sent (or, when the
    rank owns both, as V placement has it, the one it kept), and the last stage's logits go to ``score``. So
    stage 1 works on microbatch 0 while stage 0 works on microbatch 1, a forward-only GPipe. Sends are
    non-blocking (two ranks that each own a stage ahead of the other would otherwise both wait in a send) and
    waited for at the end; receives are in the same order on both sides of every pair, so they match, and the
    earliest unfinished pair's input is always sent already, so nothing waits forever. Each message is a small
    header (dtype and shape) and the activation, so nothing about the shapes is assumed.
    """

    def __init__(self, stages: dict[int, nn.Module], owner: list[int], group, device: torch.device):
        self.stages, self.owner, self.group, self.device = stages, owner, group, device
        self.me = dist.get_rank(group)

    def __call__(self, chunks: list[torch.Tensor], score, documents: list[Documents | None]) -> None:
        """Run ``chunks`` (the microbatches' tokens; read only where this rank holds the first stage) through the
        pipeline, each stage's attention masked by its microbatch's ``documents`` (None: causal);
        ``score(j, logits)`` for each microbatch ``j`` where this rank holds the last stage."""
        last, sends, kept = len(self.owner) - 1, [], list(chunks)
        for s in sorted(self.stages):
            outputs = []
            for j in range(len(chunks)):
                x = kept[j] if s == 0 or self.owner[s - 1] == self.me else self._recv(self.owner[s - 1])
                with attending([self.stages[s]], documents[j]):
                    y = self.stages[s](x)
                if s == last:
                    score(j, y)
                elif self.owner[s + 1] == self.me:
                    outputs.append(y)
                else:
                    sends.extend(self._send(y, self.owner[s + 1]))
            kept = outputs
        for work, _ in sends:
            work.wait()

    def _peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank)

    def _send(self, x: torch.Tensor, to: int) -> list[tuple]:
        """The header and the activation on their way to ``to``: (work, tensor) pairs, the tensors kept alive until
        the work is waited for."""
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(x.dtype), x.dim()
        header[2:2 + x.dim()] = torch.tensor(x.shape)
        out = []
        for tensor in (header.to(self.device), x.contiguous()):
            out.append((dist.isend(tensor, self._peer(to), group=self.group), tensor))
        return out

    def _recv(self, source: int) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, self._peer(source), group=self.group)
        dtype, ndim, *dims = header.tolist()
        x = torch.empty(dims[:ndim], dtype=_DTYPES[dtype], device=self.device)
        dist.recv(x, self._peer(source), group=self.group)
        return x


class Evaluator:
    """Scores this rank's model parts on ``EvalData``; ``sweep`` is set where the model is pipelined."""

    def __init__(self, modules: list[nn.Module], data: EvalData, microbatches: int, device: torch.device,
                 autocast, sweep: PipelineSweep | None = None, head_part: nn.Module | None = None):
        """``head_part``: the (unwrapped) part holding the last stage, whose ``loss_chunks`` says how a loss is
        taken (``model_loss``); None where this rank holds no last stage."""
        self.modules, self.data, self.microbatches, self.device = modules, data, microbatches, device
        self.autocast, self.sweep, self.head_part = autocast, sweep, head_part
        self.holds_last = head_part is not None

    def run(self) -> tuple[float | None, float]:
        """(mean token loss of this rank's share, or None off the last stage; seconds it took)."""
        start = time.perf_counter()
        losses = []
        batches = list(self.data)  # read now: whether the data carries a loss mask says how a loss is taken
        with _eval_mode(self.modules), torch.no_grad(), self.autocast():
            for inputs, targets, ids in batches:
                xs = [x.to(self.device) for x in inputs.chunk(self.microbatches)]
                ys = [y.to(self.device) for y in targets.chunk(self.microbatches)]
                documents = split_documents(ids, self.microbatches, self.device)
                if self.sweep is not None:
                    self.sweep(xs, lambda j, logits, ys=ys: losses.append(self._loss(logits, ys[j])), documents)
                else:
                    losses.extend(self._score(x, y, d) for x, y, d in zip(xs, ys, documents))
        _reshard(self.modules)
        loss = self._figure(losses) if self.holds_last else None
        return loss, time.perf_counter() - start

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One microbatch's token loss: the mean, or under a loss mask the counted targets' sum."""
        return model_loss(self.head_part, logits, targets, "mean" if self.data.counted is None else "sum")

    def _figure(self, losses: list[torch.Tensor]) -> float:
        """This rank's figure from its microbatches' losses (``_loss``): their mean, or under a loss mask their
        sum as a share of the whole set's count (0 when nothing counts)."""
        if self.data.counted is None:
            return float(torch.stack(losses).mean())
        return float(torch.stack(losses).sum()) * self.data.shares / max(self.data.counted, 1)


    def _score(self, x: torch.Tensor, y: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        """One microbatch's token loss (``_loss``) through the whole model part."""
        with attending([self.modules[0]], documents):
            return self._loss(self.modules[0](x), y)


@contextlib.contextmanager
def _eval_mode(modules: list[nn.Module]):
    """Every submodule in eval mode for the block, then back in the mode it had (not blindly ``train()``: a frozen
    part may have been left in eval mode on purpose)."""
    modes = {m: m.training for part in modules for m in part.modules()}
    for part in modules:
        part.eval()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training


def _reshard(modules: list[nn.Module]) -> None:
    """FSDP2 units gathered for the evaluation go back to their shards: under ZeRO-2 a forward keeps them gathered
    for the backward that an evaluation never runs, which would hold the whole model until the next step."""
    for part in modules:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
