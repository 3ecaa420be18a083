"""Spawned gloo ranks stepping ``WholeMatrixMuon`` over bare matrices, for its unit test and ``benchmarks/muon.py``.

Each rank holds the same matrices (drawn from one seed) either as FSDP2 holds them (``sharded``: DTensors of
``Shard(dim)`` over a 1-D mesh of every rank) or as ZeRO-0 does (``replicated``: plain tensors, DDP's replicated
gradients); every step's gradients come from one seed too, so every rank sees the whole-matrix gradient a single
process would. Each rank reports the whole matrices after the steps, how many Newton-Schulz iterations it ran, and
each step's optimizer time.
"""

from __future__ import annotations

import time

import torch

SEED = 1234


def matrices(shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The matrices every rank and the single-process reference start from."""
    gen = torch.Generator().manual_seed(SEED)
    return [torch.randn(shape, generator=gen) * 0.02 for shape in shapes]


def gradients(shapes: list[tuple[int, int]], step: int) -> list[torch.Tensor]:
    """Step ``step``'s whole gradients (the same on every rank: DDP's all-reduced ones, FSDP2's before the split)."""
    gen = torch.Generator().manual_seed(SEED + 1 + step)
    return [torch.randn(shape, generator=gen) for shape in shapes]


def reference(shapes: list[tuple[int, int]], steps: int, **muon) -> list[torch.Tensor]:
    """PyTorch's Muon on one process over the whole matrices."""
    params = [torch.nn.Parameter(m) for m in matrices(shapes)]
    opt = torch.optim.Muon(params, **muon)
    for step in range(steps):
        for p, g in zip(params, gradients(shapes, step)):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def rank_main(rank: int, world: int, ports, cases: list[dict], results) -> None:
    """Every case of ``cases`` (``layout``: sharded/replicated, ``shard_dim``, ``split``, ``optimizer``: the class
    to step with, ``shapes``, ``steps``, ``muon``: its keywords) on this rank; puts ``{case index: report}``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from workers.optim import muon as module
    from workers.parallel.process_group import join_on_loopback

    torch.set_num_threads(1)
    port, listener = ports.join(rank, 0)
    join_on_loopback(rank, world, port, listener=listener)
    mesh = init_device_mesh("cpu", (world,))
    calls = [0] * len(cases)
    newton_schulz, running = module._zeropower_via_newtonschulz, [0]

    def counted(*args):
        calls[running[0]] += 1
        return newton_schulz(*args)

    module._zeropower_via_newtonschulz = torch.optim._muon._zeropower_via_newtonschulz = counted  # ours, PyTorch's
    built = [_build(case, mesh, dist.group.WORLD) for case in cases]
    times: list[list[float]] = [[] for _ in cases]
    for step in range(max(case["steps"] for case in cases)):  # the cases in turns: each step sees the same load
        for i, (case, (params, opt)) in enumerate(zip(cases, built)):
            if step < case["steps"]:
                running[0] = i
                times[i].append(_step(case, mesh, params, opt, step))
    results.put((rank, {i: {"matrices": _whole(params), "step_s": times[i], "newton_schulz": calls[i]}
                        for i, (params, _) in enumerate(built)}))
    dist.destroy_process_group()


def _build(case: dict, mesh, group) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """One case's matrices, laid out as ``layout`` says, and its optimizer (one param group per matrix)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = case["layout"] == "sharded"
    params = [torch.nn.Parameter(distribute_tensor(m, mesh, [Shard(case.get("shard_dim", 0))]) if sharded else m)
              for m in matrices(case["shapes"])]
    kwargs = dict(case["muon"])
    if case.get("split") is not None:
        kwargs.update(replicated_group=group, split_replicated=case["split"])
    return params, case["optimizer"]([{"params": [p]} for p in params], **kwargs)


def _step(case: dict, mesh, params: list, opt: torch.optim.Optimizer, step: int) -> float:
    """Step ``step``'s gradients in, one optimizer step: its seconds, from every rank ready to every rank done."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    for p, g in zip(params, gradients(case["shapes"], step)):
        p.grad = distribute_tensor(g, mesh, p.placements) if isinstance(p, DTensor) else g
    dist.barrier()
    start = time.perf_counter()
    opt.step()
    dist.barrier()
    return time.perf_counter() - start


def _whole(params: list) -> list:
    """The whole matrices, by value (a tensor would go through shared memory, gone once the rank exits)."""
    from torch.distributed.tensor import DTensor

    return [(p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()).numpy() for p in params]


def run(world: int, cases: list[dict], timeout_s: float = 300.0) -> dict[int, dict]:
    """``cases`` on ``world`` spawned gloo ranks: ``{rank: {case index: report}}``."""
    from tests.support.parity_harness import rank_ports, spawn_ranks

    return spawn_ranks(rank_main, (world, rank_ports(1), cases), world, timeout_s)
