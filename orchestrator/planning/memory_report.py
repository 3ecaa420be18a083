"""Driver side of memory: the fit warning before start, and measured-vs-predicted in the summary.

``fit_problems`` runs before any actor exists: it compares the planner's
per-rank peak with the device memory (``parallel.device_memory``, else the
first local GPU's size; on a CPU-only driver without the setting there is
nothing to compare with, so no check). ``MeasuredMemory`` keeps, per rank, the
bytes each category reached in the latest step (``memory.measure: true``): the
steady state, since a pipeline's first step also runs PyTorch's shape
inference, an extra forward that is not the schedule's. It pairs them with the
prediction and the relative error; ``step_peak`` is the in-step peak of all of
them together (sampled during forward and backward), against the planner's
per-rank peak less the buffers the probe does not see (pipeline receive
buffers, ZeRO-0/1's flat gradient copies; autocast's weight copies it does see).
"""

from __future__ import annotations

from dataclasses import replace

from orchestrator.events import event
from orchestrator.planning.estimate import (
    RankEstimate,
    autocast_copy_bytes,
    estimate,
    estimate_rank,
    local_seq,
    peak_rank,
)
from orchestrator.planning.memory_model import suggested_loss_chunks
from orchestrator.spec import JobSpec
from orchestrator.units import human_bytes

CATEGORIES = ("params", "grads", "optimizer", "activations")


def device_memory(spec: JobSpec) -> int | None:
    if spec.parallel.device_memory is not None:
        return spec.parallel.device_memory_bytes
    if spec.parallel.device == "cpu":
        return None
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def fit_problems(spec: JobSpec) -> list[str]:
    """One line per rank whose predicted peak exceeds the device memory (empty when it fits or is unknown)."""
    limit = device_memory(spec)
    if limit is None:
        return []
    return [f"rank {r.rank} needs {human_bytes(r.total_bytes)} (state {human_bytes(r.state.peak)}, activations "
            f"{human_bytes(r.activation_bytes)}, buffers {human_bytes(r.buffer_bytes)}) of {human_bytes(limit)}"
            for r in estimate(spec) if r.total_bytes > limit]


def loss_chunks_advice(spec: JobSpec) -> str | None:
    """Under ``train.loss_chunks: 1``, a line naming the chunk count to set when the loss's [tokens, vocab] logits
    (saved log-probabilities and the loss backward's gradients) are a quarter or more of the largest rank's
    peak, the share a real vocabulary often takes; else None."""
    chunks = _suggested_chunks(spec)
    if spec.train.loss_chunks != 1 or chunks == 1:
        return None
    whole = peak_rank(spec)
    chunked = estimate_rank(spec.with_overrides([f"train.loss_chunks={chunks}"]), whole.rank)
    saved = whole.total_bytes - chunked.total_bytes
    if 4 * saved < whole.total_bytes:
        return None
    return (f"the loss's [tokens, vocab] logits take {human_bytes(saved)} of rank {whole.rank}'s "
            f"{human_bytes(whole.total_bytes)}: set train.loss_chunks: {chunks} (the head and loss a chunk of tokens "
            f"at a time, recomputed in backward) for {human_bytes(chunked.total_bytes)}")


def _suggested_chunks(spec: JobSpec) -> int:
    """``memory_model.suggested_loss_chunks`` for this job's vocabulary, width and tokens a rank's sequence holds."""
    return suggested_loss_chunks(spec.padded_vocab_size, spec.model.d_model, local_seq(spec))


def warn_if_too_big(spec: JobSpec) -> list[str]:
    problems = fit_problems(spec)
    if problems:
        event("memory_warning", problem=f"the layout will not fit: {problems[0]}"
              + (f" (and {len(problems) - 1} more rank(s))" if len(problems) > 1 else ""),
              fix="run `raymesh plan JOB.yaml --nodes N --gpus-per-node G --gpu-mem SIZE` for a layout that fits, "
                  "or raise parallel.zero, parallel.pp, parallel.tp, set memory.recompute: full, "
                  + ("" if spec.train.loss_chunks > 1 else f"train.loss_chunks: {_suggested_chunks(spec)}, ") +
                  "or lower train.global_batch_size / raise train.microbatches")
    return problems


def probe_visible_peak(spec: JobSpec, predicted: RankEstimate) -> int:
    """The predicted in-step peak as the probe counts it: less the buffers it cannot see (pipeline receive
    buffers), ZeRO-0/1's flat gradient copies for their reduction (``ModelState.reducing``: no parameter, gradient
    or optimizer state holds them) and the loss backward's transient gradients (no saved tensor holds them), plus
    autocast's weight copies, which it sees among the saved tensors."""
    seen = replace(predicted, loss_bytes=0, state=replace(predicted.state, reducing=0))
    return seen.total_bytes - seen.buffer_bytes + autocast_copy_bytes(spec, seen.params)


class MeasuredMemory:
    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.latest: dict[int, dict[str, int]] = {}

    def observe(self, results: list[dict]) -> None:
        self.latest.update({r["rank"]: r["memory"] for r in results if "memory" in r})

    def summary(self) -> dict[int, dict]:
        """Per rank: measured and predicted bytes, and (predicted - measured) / measured per category."""
        out = {}
        for rank, measured in sorted(self.latest.items()):
            predicted = estimate_rank(self.spec, rank)
            # the probe sees autocast's weight copies among the saved tensors, so they join activations here
            saved = predicted.activation_bytes + autocast_copy_bytes(self.spec, predicted.params)
            pred = {"params": predicted.state.params, "grads": predicted.state.grads,
                    "optimizer": predicted.state.optimizer, "activations": saved}
            pred["model_state"] = pred["params"] + pred["grads"] + pred["optimizer"]
            if "step_peak" in measured:
                pred["step_peak"] = probe_visible_peak(self.spec, predicted)
            meas = {**measured, "model_state": sum(measured[k] for k in CATEGORIES[:3])}
            out[rank] = {"measured": meas, "predicted": pred,
                         "relative_error": {k: (pred[k] - meas[k]) / meas[k] for k in pred if meas.get(k)}}
        return out
