"""The distributed optimizer's flat layout on uneven shapes, without process groups.

The parity layouts (tests/integration/test_distributed_optimizer.py) use widths that dp divides; here rows that
it does not (chunks of 2, 2, 1 and an empty one) go through the buffer and back, and each dp rank's slot holds
exactly the rows ``torch.chunk`` (DTensor's ``Shard(0)`` rule) gives it.
"""

from __future__ import annotations

import pytest
import torch

from workers.parallel.distributed_optimizer import _gather_rows, _scatter_rows, _Slot, dim0_chunk


@pytest.mark.parametrize("rows, parts", [(5, 4), (8, 2), (3, 4), (1, 2), (7, 3)])
def test_dim0_chunk_follows_torch_chunk(rows, parts):
    chunks = [c.shape[0] for c in torch.arange(rows).chunk(parts)]
    chunks += [0] * (parts - len(chunks))  # torch.chunk drops empty tail chunks; DTensor keeps them empty
    assert [b - a for a, b in (dim0_chunk(rows, parts, i) for i in range(parts))] == chunks


def test_rows_reach_their_rank_slot_and_come_back_whole():
    dp, shapes = 4, [(5, 3), (2,), (8, 2)]  # rows 5 -> 2,2,1,0; rows 2 -> 1,1,0,0; rows 8 -> 2 each
    slots, offset = [], 0
    for shape in shapes:
        row = int(torch.Size(shape[1:]).numel())
        width = -(-shape[0] // dp) * row
        slots.append(_Slot(torch.nn.Parameter(torch.randn(shape)), None, offset, width))
        offset += width
    flat = torch.zeros(dp * offset)
    for slot in slots:
        _scatter_rows(slot.param.data, flat, slot, dp, offset)
    for slot in slots:
        for d in range(dp):
            start, stop = dim0_chunk(slot.param.shape[0], dp, d)
            rows = slot.param.data[start:stop].reshape(-1)
            assert torch.equal(flat[d * offset + slot.offset:][:rows.numel()], rows)
    for slot in slots:
        restored = torch.zeros_like(slot.param.data)
        _gather_rows(flat, restored, slot, dp, offset)
        assert torch.equal(restored, slot.param.data)
