"""What `parallel.cp` (context parallelism) needs from the model and the rest of the layout.

Checked before any actor starts, each refusal naming the field, the value and the fix: the sequence must cut
into `2*cp` equal chunks (the zigzag split, `workers.parallel.context_layout`), Ulysses must be able to deal
whole heads to the cp ranks, and features whose ranks are keyed by the data-parallel coordinate alone are
refused with cp.
"""

from __future__ import annotations

from math import lcm
from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from orchestrator.spec.fields import _divisors, _near_multiples

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


CP_FAMILIES = ("gpt", "llama", "gpt_oss")  # families whose attention core takes a context shard (workers.model.gpt)


def check_context_parallel(job: JobSpec) -> None:
    p, m = job.parallel, job.model
    if p.cp == 1:
        return
    if m.arch not in CP_FAMILIES:
        raise SpecError("model.arch", m.arch, f"has no context-parallel attention (parallel.cp={p.cp})",
                        f"use model.arch from {list(CP_FAMILIES)}, or set parallel.cp: 1")
    if p.dp_sync == "ps":
        raise SpecError("parallel.dp_sync", "ps", f"is not supported with parallel.cp={p.cp} (parameter-server "
                        "keys are per data rank, cp ranks would push the same keys)",
                        "use parallel.dp_sync: allreduce, or parallel.cp: 1")
    _check_moe(job)
    _check_sequence_split(job)
    if p.cp_impl == "ulysses":
        _check_ulysses_heads(job)


def _check_moe(job: JobSpec) -> None:
    """MoE under cp: a cp rank holds part of each sequence. ``router: topk`` decides per token and forms its balance
    loss from the whole sequence's fractions and mean probabilities, averaged over cp (``moe.over_context``); the
    other routers' capacity queues, per-sequence noise and token orders, and expert dropout's keys, read token
    positions a cp rank does not have in sequence order."""
    p, moe = job.parallel, getattr(job.model, "moe", None)
    if moe is None:
        return
    if moe.router != "topk":
        raise SpecError("model.moe.router", moe.router, f"is not supported with parallel.cp={p.cp} yet: its "
                        "capacity, noise or token order is per sequence, and a cp rank holds only part of each",
                        "use model.moe.router: topk (dropless, per token) under cp, or set parallel.cp: 1")
    if moe.expert_dropout > 0:
        raise SpecError("model.moe.expert_dropout", moe.expert_dropout, f"is not supported with parallel.cp={p.cp}"
                        " yet: its mask is keyed by each token's stream position, which cp's zigzag shares reorder",
                        "set model.moe.expert_dropout: 0 under cp, or parallel.cp: 1")


def _check_sequence_split(job: JobSpec) -> None:
    """The zigzag split cuts seq_len into 2*cp chunks; sequence parallelism then splits a rank's share by tp."""
    p, seq = job.parallel, job.model.seq_len
    step = 2 * p.cp
    why = f"is not divisible by 2*parallel.cp = {step} (each cp rank holds two of 2*cp equal chunks)"
    if p.sequence_parallel and p.tp > 1:
        step = lcm(step, p.cp * p.tp)
        why = (f"does not split into 2*cp = {2 * p.cp} equal chunks whose per-rank share (seq_len/cp) divides "
               f"by tp = {p.tp} for sequence parallelism: it must be a multiple of {step}")
    if seq % step:
        cps = [c for c in _divisors(seq) if seq % (2 * c) == 0 and (not p.sequence_parallel or (seq // c) % p.tp == 0)]
        raise SpecError("model.seq_len", seq, why,
                        f"set model.seq_len to a multiple of {step} (e.g. {_near_multiples(seq, step)}), "
                        f"or pick parallel.cp from {cps}")


def ulysses_splits(hq: int, hkv: int, cp: int) -> bool:
    """Whether Ulysses can deal heads to ``cp`` ranks: query heads whole per rank, K/V heads split the same
    way or, fewer than cp, replicated (the rule ``workers.parallel.context_parallel.check_ulysses_heads``
    enforces at run time; restated here so the spec check needs no torch)."""
    return hq % cp == 0 and (hkv % cp == 0 or cp % hkv == 0)


def _check_ulysses_heads(job: JobSpec) -> None:
    """Ulysses trades the sequence split for a head split of each tp rank's heads."""
    p, m = job.parallel, job.model
    hq, hkv = m.n_heads // p.tp, m.kv_heads // p.tp
    if not ulysses_splits(hq, hkv, p.cp):
        cps = [c for c in range(2, hq + 1) if ulysses_splits(hq, hkv, c) and m.seq_len % (2 * c) == 0]
        raise SpecError("parallel.cp", p.cp, f"cannot split the heads of one tp rank (model.n_heads/tp = {hq} "
                        f"query, model.n_kv_heads/tp = {hkv} key/value heads) for parallel.cp_impl: ulysses, "
                        "which needs query heads divisible by cp and key/value heads divisible by cp or "
                        "dividing it",
                        f"pick parallel.cp from {cps}, or use parallel.cp_impl: ring or allgather")
