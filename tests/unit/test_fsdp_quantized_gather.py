"""``parallel.param_gather_dtype`` at ZeRO-2/3: what FSDP2's forward computes with when its all-gather carries int8
codes or bf16 (``workers/parallel/fsdp_quantized_gather.py``), on 2 spawned gloo ranks with the real ``fully_shard``.

Stated (docs/guides/hybrid-sharding.md) and checked here, as ZeRO-1's bounds
(tests/unit/test_quantized_gather_bound.py): per element ``|w_gathered - w| <= max|block| / 254`` for int8, blocks
of 256 values restarting at each rank's shard, and ``<= 2^-8 |w|`` for bf16; a parameter whose rows do not split
evenly over the ranks goes as bf16 under int8 (its bound is bf16's); both ranks compute with the same weights; and
the state dict hands a checkpoint the exact fp32 shards as plain tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support.parity_harness import gloo_dp_mesh, rank_ports, spawn_ranks
from workers.contract.param_gather import BLOCK

SHAPES = {"w": (300, 7), "v": (2, 513), "b": (5,)}  # a tail block per shard, a row wider than a block, uneven rows
DTYPES = ("fp32", "bf16", "int8")


def _exact(name: str, shape) -> torch.Tensor:
    """Values over four orders of magnitude, the same on every rank."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[-1])


class _Seen(nn.Module):
    """Parameters whose forward records the values it computes with (FSDP2 has gathered them by then)."""

    def __init__(self):
        super().__init__()
        for name, shape in SHAPES.items():
            self.register_parameter(name, nn.Parameter(_exact(name, shape)))
        self.seen = {}

    def forward(self):
        self.seen = {n: p.detach().clone() for n, p in self.named_parameters()}
        return sum(p.sum() for p in self.parameters())


def _rank_main(rank: int, ports, results) -> None:
    from torch.distributed.fsdp import fully_shard

    from workers.parallel.fsdp_quantized_gather import wrap_for_gather
    from workers.state.train_state import plain_shards

    mesh = gloo_dp_mesh(rank, ports, 2)
    out = {}
    for dtype in DTYPES:
        module = _Seen()
        wrap_for_gather(module, dtype)
        fully_shard(module, mesh=mesh)
        module().backward()
        state = plain_shards(module.state_dict())
        out[dtype] = ({n: t.numpy() for n, t in module.seen.items()},
                      {n: type(v.to_local()).__name__ for n, v in state.items()},
                      {n: v.full_tensor().numpy() for n, v in state.items()})
    dist.destroy_process_group()
    results.put((rank, out))


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_rank_main, (rank_ports(1),), 2, timeout_s=180)


def _int8_bound(exact: torch.Tensor) -> torch.Tensor:
    """max|block| / 254 per element, blocks of ``BLOCK`` over each rank's (padded, flattened) shard of rows."""
    shards = exact.reshape(2, -1)  # the even-row parameters: each rank's rows, flattened
    width = -(-shards.shape[1] // BLOCK) * BLOCK
    blocks = nn.functional.pad(shards, (0, width - shards.shape[1])).view(2, -1, BLOCK)
    bound = (blocks.abs().amax(2, keepdim=True) / 254).expand_as(blocks).reshape(2, -1)[:, :shards.shape[1]]
    return bound.reshape(exact.shape)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gathered_weights_are_within_zero1s_bounds_and_the_same_on_every_rank(ranks, dtype):
    for name, shape in SHAPES.items():
        seen = [torch.from_numpy(ranks[r][dtype][0][name]) for r in (0, 1)]
        exact = _exact(name, shape)
        assert torch.equal(seen[0], seen[1])
        err = (seen[0] - exact).abs()
        if dtype == "fp32":
            assert torch.equal(seen[0], exact)
            continue
        assert err.max() > 0  # the wire did round
        if dtype == "int8" and shape[0] % 2 == 0:
            assert torch.all(err <= _int8_bound(exact) * (1 + 2.0 ** -20))  # float32 arithmetic of the bound
            assert err.max() > 0.5 * _int8_bound(exact).max() * 2.0 ** -8  # int8, not a finer code
            assert not torch.all(err <= exact.abs() * 2.0 ** -8)  # coarser than bf16 somewhere: really int8
        else:  # bf16, and int8's unevenly split parameters
            assert torch.all(err <= exact.abs() * 2.0 ** -8)


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_the_checkpointed_shards_are_the_exact_fp32_masters_as_plain_tensors(ranks, dtype):
    for rank in (0, 1):
        kinds, full = ranks[rank][dtype][1], ranks[rank][dtype][2]
        assert set(kinds.values()) == {"Tensor"}
        for name, shape in SHAPES.items():
            assert torch.equal(torch.from_numpy(full[name]), _exact(name, shape))
