"""The single-process reference every parallel layout is checked against.

Plain PyTorch on purpose: the model and data reader are shared with the
workers, but none of the parallel wrappers, trainer or optimizer plumbing is,
so a bug there cannot hide in both sides of a parity test.
"""

from __future__ import annotations

import copy

import torch
from torch.func import functional_call

from orchestrator import JobSpec
from workers.data import DataCursor, TokenDataset, open_data
from workers.data.loader import document_eos, document_ids
from workers.finetune import prepare_model
from workers.model import moe
from workers.model.documents import Documents, attending
from workers.model.gpt import lm_loss
from workers.model.hf_io import load_hf_weights
from workers.model.meta_init import build_full
from workers.model.registry import model_config
from workers.optim.sm3 import SM3
from workers.parallel.partition import stage_bounds


def _decay_groups(params: list[torch.nn.Parameter], optim) -> list[dict]:
    """``params`` by weight decay, spelled out here rather than taken from the ranks' plumbing: under
    ``weight_decay_exclude: 1d`` the 1-D ones (norm weights, biases) do not decay, the matrices do."""
    spared = [p for p in params if optim.weight_decay_exclude == "1d" and p.dim() < 2]
    decayed = [p for p in params if all(p is not q for q in spared)]
    return [{"params": decayed, "weight_decay": optim.weight_decay}, {"params": spared, "weight_decay": 0.0}]


def _adamw(params: list[torch.nn.Parameter], optim) -> torch.optim.AdamW:
    """The job's AdamW over ``params``, in ``_decay_groups``."""
    return torch.optim.AdamW(_decay_groups(params, optim), lr=optim.lr, betas=optim.betas)


class _MuonAndAdamW:
    """``optim.name: muon`` spelled out: PyTorch's Muon over the blocks' 2-D weights (names ``layers.<i>.``), AdamW
    over everything else (embeddings, head, norms, 3-D expert stacks), both stepped."""

    def __init__(self, model: torch.nn.Module, optim):
        named = list(model.named_parameters())
        matrices = [p for n, p in named if n.startswith("layers.") and p.dim() == 2]
        rest = [p for _, p in named if all(p is not q for q in matrices)]
        self.parts = [torch.optim.Muon(matrices, lr=optim.lr, weight_decay=optim.weight_decay,
                                       momentum=optim.muon_momentum, nesterov=optim.muon_nesterov,
                                       ns_steps=optim.muon_ns_steps, adjust_lr_fn="match_rms_adamw"),
                      _adamw(rest, optim)]

    def step(self) -> None:
        for opt in self.parts:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.parts:
            opt.zero_grad()


def _optimizer(model: torch.nn.Module, optim):
    """The job's optimizer over the whole ``model``: AdamW, SM3 (our own: its sharded step is what a layout's
    parity checks), PyTorch's Adafactor (the sharded one, workers/optim/adafactor.py, must match it) or Muon with
    AdamW."""
    if optim.name == "muon":
        return _MuonAndAdamW(model, optim)
    if optim.name == "sm3":
        return SM3(_decay_groups(list(model.parameters()), optim), lr=optim.lr, momentum=optim.momentum)
    if optim.name == "adafactor":
        return torch.optim.Adafactor(_decay_groups(list(model.parameters()), optim), lr=optim.lr, foreach=False)
    return _adamw(list(model.parameters()), optim)


def _base_model(spec: JobSpec) -> torch.nn.Module:
    """The job's model before any adapter: the ranks' per-parameter draw, whole, or its ``init_from`` weights."""
    # the same per-parameter draw the ranks' meta-device build uses (workers.model.meta_init), whole
    model = build_full(model_config(spec.worker_dict()["model"]), spec.train.seed)
    if spec.model.init_from is not None:  # read whole here; the layouts read their slices
        load_hf_weights(model, spec.model.init_from)
    return model


def _lm_objective(spec: JobSpec):
    """``loss(model, inputs, targets)``: the mean cross entropy over the batch's counted targets; with
    ``model.mtp_layers`` the multi-token prediction loss joins its gradient (``tests/support/mtp_reference.py``)."""
    if getattr(spec.model, "mtp_layers", 0):
        from tests.support.mtp_reference import mtp_objective

        return mtp_objective
    return lambda model, inputs, targets: lm_loss(model(inputs), targets)


def _dpo_objective(spec: JobSpec):
    """``loss(model, inputs, targets)`` of ``train.objective: dpo``, spelled out apart from the ranks' code: the
    batch's rows are pairs (chosen, rejected); a row's log-probability is the sum over its counted targets of
    ``log_softmax`` at the target; the reference policy is a second, frozen copy of the model without adapters
    (not the adapters switched off); the loss is the mean over the global batch's pairs of
    ``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``."""
    reference = _base_model(spec).requires_grad_(False)
    beta = spec.train.dpo_beta

    def logps(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        counted = targets != -100
        logp = torch.log_softmax(model(inputs).float(), -1).gather(-1, targets.clamp(min=0).unsqueeze(-1))
        return (logp.squeeze(-1) * counted).sum(-1)

    def loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ratio = logps(model, inputs, targets) - logps(reference, inputs, targets)
        return -torch.nn.functional.logsigmoid(beta * (ratio[0::2] - ratio[1::2])).mean()
    return loss


def reference_run(spec: JobSpec, steps: int, after_step=None) -> tuple[list[float], list[float]]:
    """Per-step losses and pre-clip gradient norms; ``after_step(model, step)`` (1-based) sees the model after
    each update. Data with a loss mask gives targets of -100 where no completion token is predicted, which the
    whole batch's mean cross entropy leaves out: the mean over the global batch's counted targets. Under
    ``train.objective: dpo`` the loss is DPO's over the batch's pairs (``_dpo_objective``)."""
    torch.manual_seed(spec.train.seed)
    model = _base_model(spec)
    if spec.model.lora is not None:  # adapters and NF4 are model code, shared like GPT itself
        prepare_model(model, spec.model.lora, spec.train.seed)
    objective = (_dpo_objective if spec.train.objective == "dpo" else _lm_objective)(spec)
    o = spec.optim
    opt = _optimizer(model, o)
    data = open_data(spec.data.path, spec.data.mix and spec.data.sources(), spec.model.seq_len, spec.data.seed)
    cursor = DataCursor(data, spec.train.global_batch_size, dp_rank=0, dp_size=1,
                        eos_id=document_eos(spec.model.attention_mask, data))
    losses, norms = [], []
    for step in range(1, steps + 1):
        if spec.train.batch_ramp is not None:  # this step's global batch (train.batch_ramp's schedule)
            cursor.global_batch = spec.train.batch_ramp.batch_at(step, spec.train.global_batch_size)
        moe.begin_step([model], spec.train.seed, cursor.start, aux_scale=1.0)  # MoE noise keyed by stream position
        inputs, targets = cursor.next_batch()
        with _within_documents(model, cursor.documents):  # model.attention_mask: document, the whole batch at once
            loss = objective(model, inputs, targets)
            loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)))
        opt.step()
        opt.zero_grad()
        moe.end_step([model], None)  # balancing biases move after the step, as on the ranks
        losses.append(loss.item())
        if after_step is not None:
            after_step(model, len(losses))
    return losses, norms


def reference_eval(spec: JobSpec, steps: int) -> dict[int, float]:
    """Step -> the held-out loss after it, where ``eval.every`` (and the last step) names one: the whole evaluation
    set (its first ``eval.batches`` x ``train.global_batch_size`` sequences) through the whole model at once, in
    eval mode without gradients, its mean token cross entropy."""
    ev = spec.eval
    data = TokenDataset(ev.path, spec.model.seq_len, spec.data.seed)
    inputs, targets = data.batch(0, ev.batches * spec.train.global_batch_size)
    eos = document_eos(spec.model.attention_mask, data)
    documents = None if eos is None else document_ids(inputs, eos)
    scores = {}

    def score(model: torch.nn.Module, step: int) -> None:
        if step % ev.every and step != spec.train.steps:
            return
        model.eval()
        with torch.no_grad(), _within_documents(model, documents):
            scores[step] = lm_loss(model(inputs), targets).item()
        model.train()

    reference_run(spec, steps, score)
    return scores


def references_by_family(spec_of, steps: int):
    """``get(family)``: (losses, grad norms, held-out losses by step) of one process for ``spec_of(family)``,
    computed once per family (a parity module's layouts of one family share it)."""
    cache: dict[str, tuple] = {}

    def get(family: str) -> tuple:
        if family not in cache:
            spec = spec_of(family)
            cache[family] = (*reference_run(spec, steps), reference_eval(spec, steps))
        return cache[family]
    return get


def assert_matches(run, reference: tuple, evaluates: bool, rel: float = 1e-4) -> None:
    """A layout's run (``parity_harness.LayoutRun``) has the reference's losses, grad norms and, where it
    evaluates, held-out losses (``references_by_family``'s tuple), within ``rel``."""
    import pytest

    losses, grad_norms, held_out = reference
    assert run.losses == pytest.approx(losses, rel=rel)
    assert run.grad_norms == pytest.approx(grad_norms, rel=rel)
    if evaluates:
        assert run.eval_losses == pytest.approx(held_out, rel=rel)


def _within_documents(model: torch.nn.Module, ids: torch.Tensor | None):
    """``model``'s attention masked by the documents ``ids`` for the block (None: causal, as without the mask)."""
    return attending([model], None if ids is None else Documents(ids))


def reference_losses(spec: JobSpec, steps: int) -> list[float]:
    return reference_run(spec, steps)[0]


def reference_versioned(spec: JobSpec, steps: int, version_of, every: int = 1) -> list[float]:
    """Per-step losses of an asynchronous pipeline (PipeDream, 2BW) from its update rule, single process.

    Stage ``s`` runs global microbatch ``n`` (per dp rank) forward and backward on weight version
    ``version_of(s, n)``, the weights after that many updates; the gradients of ``every`` microbatches,
    averaged over them and over dp, make one update of every stage (the job's optimizer, ``_optimizer``). The
    stages are ``spec``'s ``pp_split`` (embeddings on the first, final norm and head on the last), so an uneven
    split is checked against the same rule as an even one. No clipping (the schedules clip per stage; give grad_clip 0).
    """
    model = build_full(model_config(spec.worker_dict()["model"]), spec.train.seed)
    stage_of = _stage_of_parameters(model, spec.stage_split)
    o = spec.optim
    opt = _optimizer(model, o)
    live = dict(model.named_parameters())
    versions = [{k: p.detach().clone() for k, p in live.items()}]  # versions[k]: the weights after k updates
    cursor = DataCursor(TokenDataset(spec.data.path, spec.model.seq_len, spec.data.seed),
                        spec.train.global_batch_size, dp_rank=0, dp_size=1)
    m, dp, losses = spec.train.microbatches, spec.parallel.dp, []
    for step in range(steps):
        inputs, targets = cursor.next_batch()
        # microbatch j of every dp rank's slice, the replicas side by side (their gradients are averaged)
        cut = [(x.chunk(m), y.chunk(m)) for x, y in zip(inputs.chunk(dp), targets.chunk(dp))]
        step_losses = []
        for j in range(m):
            n = step * m + j
            x, y = torch.cat([xs[j] for xs, _ in cut]), torch.cat([ys[j] for _, ys in cut])
            weights = {k: versions[version_of(stage_of[k], n)][k].clone().requires_grad_() for k in live}
            loss = lm_loss(functional_call(model, weights, (x,)), y)
            for p, g in zip(live.values(), torch.autograd.grad(loss / every, list(weights.values()))):
                p.grad = g if p.grad is None else p.grad + g
            step_losses.append(loss.item())
            if (n + 1) % every == 0:
                opt.step()
                opt.zero_grad()
                versions.append({k: p.detach().clone() for k, p in live.items()})
        losses.append(sum(step_losses) / m)
    return losses


def _stage_of_parameters(model: torch.nn.Module, split) -> dict[str, int]:
    """Parameter name -> the pipeline stage holding it under ``split`` (layer counts per stage): a block's
    parameters go with its layer, the embeddings to the first stage, the rest (final norm, head) to the last."""
    layer_stage = {str(i): s for s, layers in enumerate(stage_bounds(split)) for i in layers}
    out = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        if parts[0] == "layers":
            out[name] = layer_stage[parts[1]]
        else:
            out[name] = 0 if parts[0].endswith("embeddings") else len(split) - 1
    return out


def reference_bf16_fsdp(spec: JobSpec, steps: int) -> tuple[list[float], list[float]]:
    """Per-step losses and pre-clip gradient norms of bf16 under FSDP2's mixed-precision policy, spelled out
    without FSDP: each data-parallel rank's microbatches run forward and backward on a bf16 copy of the fp32
    weights (buffers keep their dtype, as FSDP2 casts parameters only); the bf16 gradients are summed in float32
    (``precision.reduce_dtype: fp32``), averaged over the ranks, clipped, and the job's optimizer (``_optimizer``)
    steps the fp32 weights."""
    torch.manual_seed(spec.train.seed)
    model = build_full(model_config(spec.worker_dict()["model"]), spec.train.seed)
    o, m, dp = spec.optim, spec.train.microbatches, spec.parallel.dp
    opt = _optimizer(model, o)
    cursor = DataCursor(TokenDataset(spec.data.path, spec.model.seq_len, spec.data.seed),
                        spec.train.global_batch_size, dp_rank=0, dp_size=1)
    losses, norms = [], []
    for _ in range(steps):
        inputs, targets = cursor.next_batch()
        low = copy.deepcopy(model)
        for p in low.parameters():
            p.data = p.data.to(torch.bfloat16)
        sums = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
        rank_losses = []
        for x_rank, y_rank in zip(inputs.chunk(dp), targets.chunk(dp)):  # each rank's slice of the batch
            total = 0.0
            for x, y in zip(x_rank.chunk(m), y_rank.chunk(m)):
                loss = lm_loss(low(x), y) / m
                grads = torch.autograd.grad(loss, list(low.parameters()))
                for (name, _), g in zip(low.named_parameters(), grads):
                    sums[name] += g.float()
                total += loss.item()
            rank_losses.append(total)
        for name, p in model.named_parameters():
            p.grad = sums[name] / dp
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)))
        opt.step()
        opt.zero_grad()
        losses.append(sum(rank_losses) / dp)
    return losses, norms


def assert_follows_reference(run, spec: JobSpec, steps: int, rel: float = 1e-4) -> None:
    """A layout's ``run`` (``parity_harness.LayoutRun``) reports the reference's losses and gradient norms."""
    import pytest

    losses, grad_norms = reference_run(spec, steps)
    assert run.losses == pytest.approx(losses, rel=rel)
    assert run.grad_norms == pytest.approx(grad_norms, rel=rel)
