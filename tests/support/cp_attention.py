"""Check the context-parallel attention functions against single-process SDPA, one spawned process per cp rank.

Why spawn and not Ray: what is checked is pure ``torch.distributed`` maths over a gloo group; one spawn per
world size runs every case (strategy × causal × head counts), so the cost is one process start per cp degree.
Each rank builds the same full-sequence inputs (fixed seed), computes the reference output and gradients with
``scaled_dot_product_attention`` on the whole sequence, runs the cp function on its zigzag slice, and reports
the largest absolute difference of the output and of dq, dk, dv on its positions.
"""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests.support.parity_harness import _collect, _join_all, _stop_leftovers, free_port

# (name, Hq, Hkv): MHA, GQA, and head counts that do not divide evenly across cp (ring/allgather take any)
HEADS = (("mha", 4, 4), ("gqa", 4, 2), ("mqa_uneven", 6, 1), ("gqa_uneven", 6, 3))


def reference(q, k, v, dout, causal: bool):
    """Single-process attention on the whole sequence: (out, dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def case_inputs(hq: int, hkv: int, seq: int, seed: int, batch: int = 2, dim: int = 8):
    """Full-sequence q, k, v and an upstream gradient, the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, seq, dim, generator=gen)
    k = torch.randn(batch, hkv, seq, dim, generator=gen)
    v = torch.randn(batch, hkv, seq, dim, generator=gen)
    return q, k, v, torch.randn(batch, hq, seq, dim, generator=gen)


def run_case(fn, group, cp: int, rank: int, hq: int, hkv: int, causal: bool, seq: int = 24) -> float:
    """Largest |cp - reference| over out, dq, dk, dv on this rank's positions."""
    from workers.parallel.context_parallel import zigzag_indices

    q, k, v, dout = case_inputs(hq, hkv, seq, seed=hq * 100 + hkv * 10 + causal)
    ref = reference(q, k, v, dout, causal)
    idx = zigzag_indices(seq, cp, rank)
    ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    out = fn(ql, kl, vl, group, causal=causal)
    out.backward(dout[:, :, idx])
    got = (out.detach(), ql.grad, kl.grad, vl.grad)
    return max((g - r[:, :, idx]).abs().max().item() for g, r in zip(got, ref))


def refusal(fn, group, hq: int, hkv: int) -> str:
    """The message ``fn`` raises for a head count it does not allow ('' when it accepts it)."""
    q, k, v, _ = case_inputs(hq, hkv, 8 * dist_world(group), seed=0)
    try:
        fn(q[:, :, :8], k[:, :, :8], v[:, :, :8], group)
    except ValueError as err:
        return str(err)
    return ""


def dist_world(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


def _rank_main(rank: int, cp: int, port: int, strategies: tuple[str, ...], results) -> None:
    import torch.distributed as dist

    from workers.parallel import context_parallel as cpa

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
    group = dist.new_group(list(range(cp)))
    out = {}
    for name in strategies:
        fn = getattr(cpa, f"{name}_attention")
        for label, hq, hkv in HEADS:
            for causal in (True, False):
                try:
                    out[(name, label, causal)] = run_case(fn, group, cp, rank, hq, hkv, causal)
                except ValueError as err:
                    out[(name, label, causal)] = f"ValueError: {err}"
    results.put((rank, out))
    dist.destroy_process_group()


def run_all(cp: int, strategies: tuple[str, ...], timeout_s: float = 120.0) -> dict:
    """Every case on ``cp`` spawned gloo ranks: {(strategy, heads, causal): worst error over ranks, or the
    ValueError text every rank raised}."""
    results = mp.get_context("spawn").Queue()
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        procs = mp.start_processes(_rank_main, args=(cp, free_port(), strategies, results), nprocs=cp,
                                   join=False, start_method="spawn")
        try:
            by_rank = _collect(results, procs, cp, timeout_s)
            _join_all(procs, timeout_s)
        finally:
            _stop_leftovers(procs)
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    merged = {}
    for case in by_rank[0]:
        values = [by_rank[r][case] for r in range(cp)]
        merged[case] = values[0] if isinstance(values[0], str) else max(values)
    return merged
