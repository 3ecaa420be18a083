"""Muon's optimizer step with the Newton-Schulz work split over owner ranks, against every rank repeating it.

One spawn of ``--dp`` gloo ranks (``tests/support/muon_ranks.py``, no Ray, one thread each) steps the same matrices,
a Llama block's seven per layer (``--layers``, ``--d-model``, ``--d-ff``), in four ways:

- ``sharded-everywhere``: FSDP2's dim-0 shards, each gradient and momentum buffer gathered whole (fp32) on every
  rank and every rank orthogonalising every matrix: ``WholeMatrixMuon`` before owners (kept below as the baseline);
- ``sharded-owners``: the same shards through ``workers.optim.muon.WholeMatrixMuon`` (bf16 look-ahead all-gathered,
  each matrix orthogonalised by its owner, the update reduce-scattered);
- ``replicated-redundant``: ZeRO-0's plain tensors, every rank orthogonalising every matrix, no communication;
- ``replicated-split``: the same with ``split_replicated``: each matrix by its owner, then broadcast.

Reported per way: the fastest optimizer step after warm-up (each step timed from every rank ready to every rank
done; the ways take turns step by step, so each sees the same load, and the best step is the one least disturbed
on this shared 2-core machine), with ratios against ``sharded-everywhere`` and ``replicated-redundant`` measured in
the same run, and how many matrices each rank orthogonalised per step.

    python benchmarks/muon.py --dp 2 --out benchmarks/results/muon_dp2.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Replicate

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.pipedream import write_rows  # noqa: E402
from tests.support import muon_ranks  # noqa: E402
from workers.optim.muon import WholeMatrixMuon  # noqa: E402

WARMUP = 2
MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "ns_steps": 5, "adjust_lr_fn": "match_rms_adamw"}


class GatheredEverywhereMuon(torch.optim.Muon):
    """The baseline: ``WholeMatrixMuon`` as it was before owners (commit 13524b6), every sharded gradient and
    buffer gathered whole on every rank for PyTorch's own step there."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._gathered = []

    def _init_group(self, group, params_with_grad, grads, muon_momentum_bufs):
        self._reshard()
        has_complex = super()._init_group(group, params_with_grad, grads, muon_momentum_bufs)
        for i, grad in enumerate(grads):
            if isinstance(grad, DTensor):
                whole = _replicated(muon_momentum_bufs[i])
                self._gathered.append((muon_momentum_bufs[i], whole))
                grads[i], muon_momentum_bufs[i] = _replicated(grad), whole
        return has_complex

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        self._reshard()
        return loss

    def _reshard(self) -> None:
        for shard, whole in self._gathered:
            shard.copy_(whole.redistribute(shard.device_mesh, shard.placements))
        self._gathered.clear()


def _replicated(tensor: DTensor) -> DTensor:
    return tensor.redistribute(tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim)


WAYS = {
    "sharded-everywhere": {"layout": "sharded", "optimizer": GatheredEverywhereMuon},
    "sharded-owners": {"layout": "sharded", "optimizer": WholeMatrixMuon},
    "replicated-redundant": {"layout": "replicated", "optimizer": WholeMatrixMuon, "split": False},
    "replicated-split": {"layout": "replicated", "optimizer": WholeMatrixMuon, "split": True},
}


def shapes(layers: int, d_model: int, d_ff: int) -> list[tuple[int, int]]:
    """A Llama block's matrices per layer: q, k, v, o, then gate and up (d_ff x d), down (d x d_ff)."""
    return [(d_model, d_model)] * 4 * layers + [(d_ff, d_model), (d_ff, d_model), (d_model, d_ff)] * layers


def measure(dp: int, steps: int, matrices: list[tuple[int, int]]) -> dict[str, dict]:
    cases = [{"shapes": matrices, "steps": steps, "muon": MUON, **way} for way in WAYS.values()]
    by_rank = muon_ranks.run(dp, cases, timeout_s=3600)
    rows = {}
    for i, name in enumerate(WAYS):
        per_step = zip(*(by_rank[r][i]["step_s"] for r in range(dp)))
        rows[name] = {"step_s": min(max(s) for s in list(per_step)[WARMUP:]),
                      "newton_schulz_per_rank": [by_rank[r][i]["newton_schulz"] // steps for r in range(dp)]}
    for name, row in rows.items():
        base = "sharded-everywhere" if name.startswith("sharded") else "replicated-redundant"
        row["vs_baseline"] = row["step_s"] / rows[base]["step_s"]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-ff", type=int, default=1376)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.data = None
    rows = measure(args.dp, args.steps, shapes(args.layers, args.d_model, args.d_ff))
    for name, row in rows.items():
        print(f"{name:>21}: optimizer step {row['step_s'] * 1e3:8.1f} ms ({row['vs_baseline']:.2f}x), "
              f"Newton-Schulz per rank {row['newton_schulz_per_rank']}")
    write_rows(args, rows)


if __name__ == "__main__":
    main()
