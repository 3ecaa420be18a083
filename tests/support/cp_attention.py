"""Check the context-parallel attention functions against single-process SDPA, one spawned process per cp rank.

Why spawn and not Ray: what is checked is pure ``torch.distributed`` maths over a gloo group; one spawn per
world size runs every case (strategy × causal × head counts), so the cost is one process start per cp degree.
Each rank builds the same full-sequence inputs (fixed seed), computes the reference output and gradients with
``scaled_dot_product_attention`` on the whole sequence, runs the cp function on its zigzag slice, and reports
the largest absolute difference of the output and of dq, dk, dv on its positions (and, with attention sinks, of
their gradient summed over the group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# (name, Hq, Hkv): MHA, GQA, and head counts that do not divide evenly across cp (ring/allgather take any)
HEADS = (("mha", 4, 4), ("gqa", 4, 2), ("gqa8", 8, 2), ("mqa_uneven", 6, 1), ("gqa_uneven", 6, 3))
# Where each sequence's documents open (24 tokens), per document-masked case (model.attention_mask: document):
# a one-token document, boundaries inside and at the edges of the zigzag chunks (cp=2: 6-token chunks, so 6 and
# 12 are chunk and rank edges; cp=4: 3-token chunks), documents crossing chunks and ranks, rows that see no key
# of some rank's block (at cp=2 queries 19-23 over rank 1's keys 6-17), and either a sequence that is one
# document or, in "split documents", one cut at 12, so that ring attention skips tiles no sequence attends to
DOCUMENTS = {"documents": ((1, 2, 6, 11, 19), ()), "split documents": ((1, 2, 6, 11, 19), (12,))}
# sliding windows (model.sliding_window), shorter than a cp=2 chunk (6 tokens) and than a cp=4 rank's share (6):
# a window of 5 keys, alone and within "documents"' documents: (window, DOCUMENTS name or None)
WINDOWS = {"window": (5, None), "window documents": (5, "documents")}
# masks: causal, none, causal within documents, and sliding windows
MASKS = (True, False, *DOCUMENTS, *WINDOWS)
# the masks also run with attention sinks (gpt-oss: one extra logit per query head), keyed (..., mask, "sinks")
SINK_MASKS = (True, "documents", "window")


def document_layout(seq: int, openings: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """Document ids [len(openings), seq], each sequence's documents opening at its ``openings`` (as
    ``document_ids`` counts them)."""
    flags = torch.zeros(len(openings), seq, dtype=torch.long)
    for b, opens in enumerate(openings):
        flags[b, list(opens)] = 1
    return flags.cumsum(-1)


def dense_mask(seq: int, causal: str) -> torch.Tensor:
    """The boolean ``[batch or 1, 1, seq, seq]`` mask of a ``DOCUMENTS`` or ``WINDOWS`` case, built densely."""
    from workers.model.documents import document_mask

    pos = torch.arange(seq)
    window, documents = WINDOWS.get(causal, (None, causal))
    back = pos[:, None] - pos[None, :]
    mask = ((back >= 0) & (back < (window or seq)))[None, None]
    if documents is not None:
        mask = mask & document_mask(document_layout(seq, DOCUMENTS[documents]), pos, pos)
    return mask


def kernel_masking(seq: int, causal: bool | str) -> dict:
    """What a cp kernel is told for a case: ``causal``, and the trainer's ``documents`` and ``window``."""
    from workers.model.documents import Documents

    if causal in (True, False):
        return {"causal": causal}
    window, documents = WINDOWS.get(causal, (None, causal))
    out = {"causal": True, **({"window": window} if window else {})}
    if documents is not None:
        out["documents"] = Documents(document_layout(seq, DOCUMENTS[documents]))
    return out


def reference(q, k, v, dout, causal: bool | str):
    """Single-process attention on the whole sequence: (out, dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    masking = {"is_causal": causal} if causal in (True, False) else {"attn_mask": dense_mask(q.shape[2], causal)}
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **masking)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def sink_attention(q, k, v, sinks, mask: torch.Tensor) -> torch.Tensor:
    """Eager attention with one extra logit per query head of value zero (transformers' gpt-oss
    ``eager_attention_forward``), under a boolean ``mask`` broadcast to ``[B, Hq, S, S]``."""
    hq, s = q.shape[1], q.shape[2]
    k, v = (t.repeat_interleave(hq // k.shape[1], 1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, s, 1)], dim=-1)
    return logits.softmax(-1)[..., :-1] @ v


def sink_reference(q, k, v, sinks, dout, causal: bool | str):
    """``reference`` with attention sinks, densely: (out, dq, dk, dv, dsinks)."""
    q, k, v, sinks = (t.detach().requires_grad_() for t in (q, k, v, sinks))
    seq = q.shape[2]
    mask = torch.ones(seq, seq, dtype=torch.bool).tril() if causal is True else dense_mask(seq, causal)
    out = sink_attention(q, k, v, sinks, mask)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad, sinks.grad


def case_inputs(hq: int, hkv: int, seq: int, seed: int, batch: int = 2, dim: int = 8):
    """Full-sequence q, k, v and an upstream gradient, the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, seq, dim, generator=gen)
    k = torch.randn(batch, hkv, seq, dim, generator=gen)
    v = torch.randn(batch, hkv, seq, dim, generator=gen)
    return q, k, v, torch.randn(batch, hq, seq, dim, generator=gen)


def run_case(fn, group, cp: int, rank: int, hq: int, hkv: int, causal: bool | str, seq: int = 24,
             sinks: bool = False) -> float:
    """Largest |cp - reference| over out, dq, dk, dv on this rank's positions (``causal`` a ``DOCUMENTS`` or
    ``WINDOWS`` name: causal within those documents or that window, handed to the kernel as the trainer does).
    With ``sinks``, attention sinks too, and their gradient summed over the group (each rank's is its rows' or
    its heads' share, as the gradient reduction over cp sums it) against the whole sequence's."""
    import torch.distributed as dist

    from workers.parallel.context_parallel import zigzag_indices

    q, k, v, dout = case_inputs(hq, hkv, seq, seed=hq * 100 + hkv * 10 + MASKS.index(causal))
    sink = torch.randn(hq, generator=torch.Generator().manual_seed(hq)) if sinks else None
    ref = sink_reference(q, k, v, sink, dout, causal) if sinks else reference(q, k, v, dout, causal)
    idx = zigzag_indices(seq, cp, rank)
    ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    extra = {"sinks": sink.clone().requires_grad_()} if sinks else {}
    out = fn(ql, kl, vl, group, **kernel_masking(seq, causal), **extra)
    out.backward(dout[:, :, idx])
    got = (out.detach(), ql.grad, kl.grad, vl.grad)
    err = max((g - r[:, :, idx]).abs().max().item() for g, r in zip(got, ref))
    if sinks:
        dsinks = extra["sinks"].grad
        dist.all_reduce(dsinks, group=group)
        err = max(err, (dsinks - ref[4]).abs().max().item())
    return err


def _rank_main(rank: int, world: int, ports, strategies: tuple[str, ...], results) -> None:
    """One rank of ``world``: every case at cp=world (one group) and at cp=2 (pairs of ranks, each its own group)."""
    import torch.distributed as dist

    from workers.model import attention_blocks
    from workers.parallel import context_parallel as cpa
    from workers.parallel.process_group import join_on_loopback

    torch.set_num_threads(1)
    attention_blocks.ROW_TILE = 4  # tiles: several per piece at cp=2 (12 local rows), one per piece at cp=4 (6)
    port, listener = ports.join(rank, 0)
    join_on_loopback(rank, world, port, listener=listener)
    groups = {world: dist.new_group(list(range(world)))}
    for first in range(0, world, 2):  # every rank must join every new_group call
        pair = dist.new_group([first, first + 1])
        if rank in (first, first + 1):
            groups[2] = pair
    out = {}
    for cp, group in groups.items():
        for name in strategies:
            fn = getattr(cpa, f"{name}_attention")
            for label, hq, hkv in HEADS:
                cases = [(causal, False) for causal in MASKS] + [(causal, True) for causal in SINK_MASKS]
                for causal, sinks in cases:
                    try:
                        err = run_case(fn, group, cp, dist.get_rank(group), hq, hkv, causal, sinks=sinks)
                    except ValueError as refusal:
                        err = f"ValueError: {refusal}"
                    out[(cp, name, label, causal, *(("sinks",) if sinks else ()))] = err
    results.put((rank, out))
    dist.destroy_process_group()


def run_all(world: int, strategies: tuple[str, ...], timeout_s: float = 300.0) -> dict:
    """Every case on ``world`` spawned gloo ranks, at cp=world and cp=2: {(cp, strategy, heads, causal): worst
    error over the ranks, or the ValueError text the ranks raised}.

    The harness is imported here, not at module level: it pulls in ``orchestrator``, which every spawned
    child (it imports this module to find ``_rank_main``) would otherwise load for nothing.
    """
    from tests.support.parity_harness import rank_ports, spawn_ranks

    by_rank = spawn_ranks(_rank_main, (world, rank_ports(1), strategies), world, timeout_s)
    merged = {}
    for case in by_rank[0]:
        values = [by_rank[r][case] for r in range(world)]
        refusals = [v for v in values if isinstance(v, str)]
        merged[case] = refusals[0] if refusals else max(values)
    return merged
