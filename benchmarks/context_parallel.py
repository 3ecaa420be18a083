"""Context-parallel attention: step time and activation memory per rank at cp = 1, 2, 4 and growing sequences.

One run measures every strategy (ring, Ulysses, all-gather) at every cp degree and sequence length, so the
ratios against cp=1 (single-process ``scaled_dot_product_attention`` on the whole sequence, what context
parallelism replaces) come from the same machine state. At cp=1 every strategy runs too, on a group of one
rank: no communication, so its ratio to SDPA is the blockwise kernels' own cost (ring and all-gather attend
each block through the fused flash kernel and merge the blocks by their log-sum-exp). Each cp degree is one
spawn of cp gloo ranks, one thread each. Per case:

- step time: fwd+bwd of one attention call between two barriers, median over ``--repeats`` (after one
  warm-up), so a step counts until the slowest rank is done; a sequence length's cases take turns in each
  round, so a machine whose load drifts weighs on each alike. Every cp > 1 spawn runs the SDPA baseline too (rank
  0 on the whole sequence, the others idle at the barrier), in the same rounds, and its rows' ratios are to that:
  on a shared machine a baseline from another spawn minutes apart measured the load as much as the kernels;
- CPU seconds: the process CPU time of the same step (its gloo threads included), the largest over the ranks, and
  its ratio to SDPA's: what a rank computes, which the load on a shared machine barely moves (the wall time
  counts the turns a loaded scheduler gives to other processes too);
- activation bytes: the bytes autograd saves for the backward (``torch.autograd.graph.saved_tensors_hooks``,
  each storage counted once), the largest over the ranks. Measured this way it works on CPU, where there is
  no allocator peak to read.

With ``--doc-len N`` every case also runs under the document mask (``model.attention_mask: document``) of a
window packed with N-token documents, as ``IMPL+documents`` (its cp=1 row: SDPA with the same mask); the
kernel's per-microbatch masks are built inside the timed step, as the first layer of a microbatch builds them.

    python benchmarks/context_parallel.py --seq 1024 2048 4096 --cp 1 2 4
    python benchmarks/context_parallel.py --seq 2048 --cp 1 4 --doc-len 256
    python benchmarks/context_parallel.py --seq 4096 16384 --cp 1 2 --impl ring --heads 4 --kv-heads 2 \
        --repeats 1 --out benchmarks/results/context_parallel_fused.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.parity_harness import rank_ports, spawn_ranks  # noqa: E402

IMPLS = ("ring", "ulysses", "allgather")


def saved_bytes(step) -> int:
    """Bytes autograd keeps for the backward while ``step`` runs its forward (each storage once)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step()
    out.backward(torch.ones_like(out))
    return sum(storages.values())


def timed(step) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one fwd+bwd between barriers (so a step counts until the
    slowest rank is done; the CPU time stops before the closing barrier, so waiting there is not counted)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    out = step()
    out.backward(torch.ones_like(out))
    cpu = time.process_time() - c0
    dist.barrier()
    return time.perf_counter() - t0, cpu


def step_times(cases: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds of each case's fwd+bwd, after one warm-up, the cases taking turns in every
    round: on a shared machine the load drifts over minutes, and interleaving gives every case the same share of
    it, so the ratios between cases hold even where the absolute times move."""
    times: dict[str, list[tuple[float, float]]] = {key: [] for key in cases}
    for round_ in range(repeats + 1):
        for key, case in cases.items():
            seconds = timed(case)
            if round_:
                times[key].append(seconds)
    return {key: tuple(statistics.median(column) for column in zip(*values)) for key, values in times.items()}


class Case:
    """One attention call on this rank's share of a sequence: ``case()`` runs the forward."""

    def __init__(self, impl: str, cp: int, rank: int, group, seq: int, args):
        impl, _, masked = impl.partition("+")
        self.doc_ids = torch.arange(seq).div(args.doc_len, rounding_mode="floor").expand(args.batch, seq) \
            if masked else None
        gen = torch.Generator().manual_seed(rank)
        # SDPA is the whole sequence on rank 0; in a cp > 1 spawn the other ranks idle (an empty step)
        self.idle = impl == "sdpa" and rank > 0
        s_local = seq if impl == "sdpa" else seq // cp
        self.q = torch.randn(args.batch, args.heads, s_local, args.dim, generator=gen, requires_grad=True)
        self.k, self.v = (torch.randn(args.batch, args.kv_heads, s_local, args.dim, generator=gen,
                                      requires_grad=True) for _ in range(2))
        self.impl, self.group = impl, group

    def __call__(self) -> torch.Tensor:
        from workers.model.documents import Documents

        documents = None if self.doc_ids is None else Documents(self.doc_ids)  # a microbatch's, built afresh
        if self.idle:
            return self.q.new_zeros((), requires_grad=True)
        if self.impl == "sdpa":
            masking = {"is_causal": True} if documents is None else {"attn_mask": documents.whole(self.q)}
            return F.scaled_dot_product_attention(self.q, self.k, self.v, **masking,
                                                  enable_gqa=self.q.shape[1] != self.k.shape[1])
        from workers.parallel import context_parallel

        masking = {} if documents is None else {"documents": documents}
        return getattr(context_parallel, f"{self.impl}_attention")(self.q, self.k, self.v, self.group, **masking)


def _rank_main(rank: int, cp: int, ports, args, results) -> None:
    from workers.parallel.process_group import join_on_loopback

    torch.set_num_threads(1)
    port, listener = ports.join(rank, 0)
    join_on_loopback(rank, cp, port, listener=listener)
    group = dist.group.WORLD
    out = {}
    for seq in args.seq:
        cases = {f"{impl}/{seq}": Case(impl, cp, rank, group, seq, args)
                 for impl in with_documents(("sdpa", *args.impl), args)}
        seconds = step_times(cases, args.repeats)
        out.update({key: {"step_s": seconds[key][0], "cpu_s": seconds[key][1], "saved_bytes": saved_bytes(case)}
                    for key, case in cases.items()})
    results.put((rank, out))
    dist.destroy_process_group()


def with_documents(impls, args) -> list[str]:
    """``impls``, and with ``--doc-len`` each again under the document mask (``IMPL+documents``)."""
    return [*impls, *(f"{impl}+documents" for impl in impls if args.doc_len)]


def run_cp(cp: int, args) -> dict:
    """Every case at one cp degree: {"impl/seq": {"step_s", "saved_bytes"}}, the worst rank's figures."""
    by_rank = spawn_ranks(_rank_main, (cp, rank_ports(1), args), cp, timeout_s=3600)
    return {key: {field: max(by_rank[r][key][field] for r in by_rank) for field in ("step_s", "cpu_s", "saved_bytes")}
            for key in by_rank[0]}


def table(measured: dict[int, dict], args) -> list[dict]:
    """One row per (cp, impl, seq) with ratios against SDPA on one rank at the same sequence length: its time and
    CPU seconds from the same spawn (same rounds), its saved bytes (the same in every spawn)."""
    rows = []
    for cp, cases in measured.items():
        for key, fig in cases.items():
            impl, seq = key.split("/")
            base = cases[f"{'sdpa+documents' if impl.endswith('+documents') else 'sdpa'}/{seq}"]
            rows.append({"cp": cp, "impl": impl, "seq": int(seq), **fig,
                         "time_ratio": fig["step_s"] / base["step_s"], "cpu_ratio": fig["cpu_s"] / base["cpu_s"],
                         "memory_ratio": fig["saved_bytes"] / base["saved_bytes"]})
    return sorted(rows, key=lambda r: (r["seq"], r["cp"], r["impl"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--doc-len", type=int, default=0, help="also run each case under a document mask of "
                    "documents this many tokens long (0: causal only)")
    ap.add_argument("--out", default="benchmarks/results/context_parallel.json")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks: one thread per rank
    measured = {cp: run_cp(cp, args) for cp in sorted(set(args.cp))}
    rows = table(measured, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"{'seq':>6}{'cp':>4} {'impl':<20}{'step s':>9}{'cpu s':>8}{'saved MiB':>11}{'time/sdpa':>10}"
          f"{'cpu/sdpa':>9}{'mem/sdpa':>9}")
    for r in rows:
        print(f"{r['seq']:>6}{r['cp']:>4} {r['impl']:<20}{r['step_s']:>9.4f}{r['cpu_s']:>8.3f}"
              f"{r['saved_bytes'] / 2**20:>11.2f}{r['time_ratio']:>10.3f}{r['cpu_ratio']:>9.3f}"
              f"{r['memory_ratio']:>9.3f}")


if __name__ == "__main__":
    main()
