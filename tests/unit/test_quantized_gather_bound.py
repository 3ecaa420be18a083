"""``parallel.param_gather_dtype``: ZeRO-1's updated slices all-gathered as int8 (blockwise, ZeRO++'s qwZ) or bf16.

Stated (docs/guides/hybrid-sharding.md) and checked here on 2 spawned gloo ranks with the real
``DistributedOptimizer``: per element ``|w_deq - w| <= max|block| / 254`` for int8 (the scale's half step) and
``<= 2^-8 |w|`` for bf16 (its unit roundoff: 8 significant bits); every rank, the owner included, ends with the
same parameters; the owner's fp32 master keeps the exact stepped value; fp32 gathers stay exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.parity_harness import gloo_dp_mesh, rank_ports, spawn_ranks
from workers.parallel import quantized_gather as qg

SHAPES = {"w": (300, 7), "b": (5,), "v": (1, 513)}  # uneven rows, a tail block, a row wider than a block


def _stepped(name: str, shape) -> torch.Tensor:
    """What every rank's optimizer would have made of the parameter: values over four orders of magnitude."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[-1])


def _rank_main(rank: int, ports, results) -> None:
    from workers.parallel.distributed_optimizer import DistributedOptimizer

    mesh = gloo_dp_mesh(rank, ports, 2)
    out = {}
    for dtype in qg.DTYPES:
        params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}
        opt = DistributedOptimizer(list(params.items()), mesh, gather_dtype=dtype)
        with torch.no_grad():
            for name, shard in opt.shards.items():  # "the step": each rank's slice of the exact values
                start, stop = _rows(SHAPES[name][0], rank)
                shard.to_local().copy_(_stepped(name, SHAPES[name])[start:stop])
        opt.all_gather()
        masters = {n: s.to_local().clone() for n, s in opt.shards.items()}
        # numpy: pickled by value (a tensor is passed as a shared-memory handle, gone once this rank exits)
        out[dtype] = ({n: p.detach().numpy().copy() for n, p in params.items()},
                      {n: m.detach().numpy() for n, m in masters.items()})
    dist.destroy_process_group()
    results.put((rank, out))


def _rows(rows: int, rank: int) -> tuple[int, int]:
    from workers.parallel.distributed_optimizer import dim0_chunk
    return dim0_chunk(rows, 2, rank)


@pytest.fixture(scope="module")
def gathered():
    ranks = spawn_ranks(_rank_main, (rank_ports(1),), 2, timeout_s=180)
    return {r: {d: tuple({n: torch.from_numpy(a) for n, a in part.items()} for part in got) for d, got in out.items()}
            for r, out in ranks.items()}



@pytest.mark.parametrize("dtype", list(qg.DTYPES))
def test_every_rank_holds_the_same_rounded_parameters_within_the_bound(gathered, dtype):
    ranks = [gathered[r][dtype][0] for r in (0, 1)]
    for name, shape in SHAPES.items():
        exact = _stepped(name, shape)
        assert torch.equal(ranks[0][name], ranks[1][name])  # replicas identical, the owner's rows included
        err = (ranks[0][name] - exact).abs()
        if dtype == "fp32":
            assert torch.equal(ranks[0][name], exact)
        elif dtype == "bf16":
            assert torch.all(err <= exact.abs() * 2.0 ** -8)
            assert err.max() > 0
        else:
            assert err.max() > 0


def test_int8_error_is_at_most_half_a_step_of_each_block():
    """The blockwise bound itself, exact block by block (the gathered values above go through these calls)."""
    flat = _stepped("flat", (4 * qg.BLOCK,)).flatten()
    flat[qg.BLOCK:2 * qg.BLOCK] = 0  # an all-zero block: scale 0, decoded exactly
    deq = qg.dequantize(qg.quantize(flat), flat.numel())
    bound = flat.view(-1, qg.BLOCK).abs().amax(1, keepdim=True) / 254
    err = (deq - flat).view(-1, qg.BLOCK).abs()
    assert torch.all(err <= bound * (1 + 2.0 ** -20))  # float32 arithmetic of the bound itself
    assert torch.all(deq[qg.BLOCK:2 * qg.BLOCK] == 0)
    assert err.max() > 0.5 * bound.max()  # the rounding is real: a bound that loose would not be tight


def test_int8_gathered_rows_are_within_their_senders_blocks(gathered):
    """Per element, through the optimizer: each sender's flat slice (slot order), quantized by blocks of 256."""
    params = gathered[0]["int8"][0]
    for rank in (0, 1):
        exact, got = _sender_buffer(lambda n, s: _stepped(n, s), rank), _sender_buffer(lambda n, s: params[n], rank)
        width = qg.padded(exact.numel())
        blocks = torch.nn.functional.pad(exact, (0, width - exact.numel())).view(-1, qg.BLOCK)
        bound = (blocks.abs().amax(1, keepdim=True) / 254).expand_as(blocks).reshape(-1)[:exact.numel()]
        assert torch.all((got - exact).abs() <= bound * (1 + 2.0 ** -20))


def _sender_buffer(values, rank: int) -> torch.Tensor:
    """``rank``'s rows of every parameter laid out as its all-gather input: one slot per parameter of
    ceil(rows / 2) rows, zero-padded (``DistributedOptimizer.all_gather``)."""
    slots = []
    for name, shape in SHAPES.items():
        rows = values(name, shape)[slice(*_rows(shape[0], rank))].reshape(-1)
        width = -(-shape[0] // 2) * (rows.numel() // max(1, _rows(shape[0], rank)[1] - _rows(shape[0], rank)[0]))
        slots.append(torch.nn.functional.pad(rows, (0, width - rows.numel())))
    return torch.cat(slots)


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_the_owners_master_keeps_the_exact_value(gathered, dtype):
    for rank in (0, 1):
        masters = gathered[rank][dtype][1]
        for name, shape in SHAPES.items():
            assert torch.equal(masters[name], _stepped(name, shape)[slice(*_rows(shape[0], rank))])
