"""The tiered offload store: values round-trip on every tier, NVMe pages leave the process on release."""

from __future__ import annotations

import os

import pytest
import torch

from workers.offload.store import OffloadSpaceError, OffloadStore

TIERS = ["cpu", "nvme"]


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("tier", TIERS)
def test_round_trip_every_dtype(tier, tmp_path):
    store = OffloadStore(tier, str(tmp_path))
    values = {
        "f32": torch.randn(33, 7),
        "bf16": torch.randn(100).bfloat16(),
        "fp8": torch.randn(64).to(torch.float8_e4m3fn),
        "int": torch.arange(10),
        "empty": torch.empty(0, 3),
    }
    for key, value in values.items():
        store.put(key, value.clone())
    store.prefetch("f32")
    for key, value in values.items():
        got = store.get(key)
        assert got.dtype == value.dtype and got.shape == value.shape
        assert torch.equal(got.view(torch.uint8), value.view(torch.uint8))
    assert store.nbytes == sum(v.numel() * v.element_size() for v in values.values())
    store.close()


@pytest.mark.parametrize("tier", TIERS)
def test_in_place_updates_persist_and_pop_deletes(tier, tmp_path):
    store = OffloadStore(tier, str(tmp_path))
    store.put("m", torch.zeros(1000))
    store.get("m").add_(3.0)
    store.release("m")
    store.prefetch("m")
    assert torch.equal(store.get("m"), torch.full((1000,), 3.0))
    store.put("m", torch.ones(5))  # overwrite with another shape
    assert torch.equal(store.pop("m"), torch.ones(5))
    assert "m" not in store and store.nbytes == 0
    assert not any(p.is_file() for p in tmp_path.rglob("*.bin"))
    store.close()
    assert not any(tmp_path.iterdir())


def test_nvme_release_returns_the_pages(tmp_path):
    """A mapped value counts in this process's resident set only between get and release."""
    store = OffloadStore("nvme", str(tmp_path))
    nbytes = 64 * 2**20
    store.put("big", torch.ones(nbytes // 4))
    store.get("big")  # waits for the write; the writer's copy is gone afterwards
    store.release("big")
    before = resident_bytes()
    value = store.get("big")
    assert float(value[:: 1024].sum()) == nbytes // 4 // 1024  # touches every page
    during = resident_bytes()
    store.release("big")
    del value
    after = resident_bytes()
    assert during - before > 0.9 * nbytes
    assert during - after > 0.9 * nbytes
    store.close()


def test_reserving_more_than_the_disk_holds_fails_early(tmp_path):
    store = OffloadStore("nvme", str(tmp_path))
    with pytest.raises(OffloadSpaceError, match="GiB free"):
        store.reserve(1 << 60)
    store.close()
