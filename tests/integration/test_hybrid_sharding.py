"""Hybrid sharding (``parallel.dp_shard``): ZeRO 1-3 sharded inside groups of dp ranks, replicated across them.

Ray-free (tests/support/parity_harness.py). Parity is against the single-process reference (fp32, CPU, 1e-4
relative) at dp=4 in two shard groups of 2, under each ZeRO stage with tensor and pipeline parallelism; a
checkpoint saved so resumes at another shard size and at plain ZeRO-3 with the state DCP hands back bit for bit.
The bytes ``metrics.comm_bytes`` counts per mesh dimension are the communication model's (5%), and the
replicas exchange only the reduction of their shard's gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.support.comm import mismatches
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped, run_layout, run_layouts
from tests.support.reference import reference_run

STEPS = 3
LAYOUTS = {  # every stage at dp=4, dp_shard=2, with tp and pp (16 ranks once, to keep the suite's time)
    "zero1-tp2": {"zero": 1, "tp": 2},
    "zero2-pp2": {"zero": 2, "pp": 2},
    "zero3-tp2-pp2": {"zero": 3, "tp": 2, "pp": 2},
}


def _spec(token_data, tmp_path, parallel: dict, steps: int = STEPS):
    return tiny_spec(token_data, tmp_path, parallel={"device": "cpu", **parallel}, train={"steps": steps})


@pytest.fixture(scope="module")
def reference(token_data, tmp_path_factory):
    return reference_run(_spec(token_data, tmp_path_factory.mktemp("ref"), {}), STEPS)


@pytest.fixture(scope="module")
def runs(token_data, tmp_path_factory):
    base = tmp_path_factory.mktemp("hsdp")
    return run_grouped({name: _spec(token_data, base / name, {"dp": 4, "dp_shard": 2, **par})
                        for name, par in LAYOUTS.items()}, timeout_s=600)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hybrid_sharding_reproduces_the_reference(name, runs, reference):
    run = ran(runs, name)
    losses, grad_norms = reference
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4)


def _state(path) -> dict:
    """A DCP checkpoint's tensors and values by key, read whole in this process (DCP's own converter)."""
    flat = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(flat))
    return _flatten(torch.load(flat, weights_only=False))


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, value in enumerate(tree) for k, v in _flatten(value, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): tree}


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


@pytest.mark.parametrize("zero", [3, 1])
def test_a_hybrid_checkpoint_reshards_to_another_shard_size_and_to_plain_zero(zero, token_data, tmp_path):
    """Saved at dp=4 in shard groups of 2 after 2 steps; loaded (and saved again at once) in one shard group of 4
    and at plain ZeRO-3 over dp=2: every tensor, optimizer moments included, comes back bit for bit, and a step
    from the resharded state continues the straight run's losses (1e-4)."""
    hybrid = _spec(token_data, tmp_path / "h", {"dp": 4, "dp_shard": 2, "zero": zero}, steps=3)
    saved = tmp_path / "step2"
    straight = run_layout(hybrid.worker_dict(), 4, 3, checkpoint=str(saved), save_after=2, timeout_s=600)
    wide = _spec(token_data, tmp_path / "w", {"dp": 4, "dp_shard": 4, "zero": zero}, steps=1)
    again_wide = tmp_path / "wide"
    run_wide, = run_layouts([wide.worker_dict()], 4, 1, 600, [str(again_wide)], [str(saved)], [0])
    plain = _spec(token_data, tmp_path / "p", {"dp": 2, "zero": 3}, steps=1)
    again_plain = tmp_path / "plain"
    run_plain = run_layout(plain.worker_dict(), 2, 1, checkpoint=str(again_plain), resume=str(saved), save_after=0,
                           timeout_s=600)
    original = _state(saved)
    _assert_same_state(_state(again_wide), original)
    _assert_same_state(_state(again_plain), original)
    assert run_wide.losses == pytest.approx(straight.losses[2:], rel=1e-4)
    assert run_plain.losses == pytest.approx(straight.losses[2:], rel=1e-4)


COUNTED = {  # world 4: a plain dp=4 all-reduce (it sends 1.5x the gradients' G bytes), hybrid layouts beside it
    "dp4-zero0": {"dp": 4},
    "zero1-dp4-shard2": {"dp": 4, "dp_shard": 2, "zero": 1},
    "zero2-dp4-shard2": {"dp": 4, "dp_shard": 2, "zero": 2},
    "zero3-dp2-shard1-cp2": {"dp": 2, "dp_shard": 1, "zero": 3, "cp": 2},
    "zero2-dp4-shard2-bf16": {"dp": 4, "dp_shard": 2, "zero": 2, "grad_reduce_dtype": "bf16"},  # the model's 2 bytes
}


def test_counted_bytes_per_mesh_dimension_are_the_models(token_data, tmp_path):
    specs = {name: tiny_spec(token_data, tmp_path / name, parallel={**fields, "device": "cpu"},
                             train={"steps": 2}, metrics={"comm_bytes": True}) for name, fields in COUNTED.items()}
    runs = dict(zip(specs, run_layouts([s.worker_dict() for s in specs.values()], 4, 2, 600), strict=True))
    assert not mismatches(specs, runs)
    gradients = runs["dp4-zero0"].field("comm_bytes")[0][-1]["dp"] / 1.5  # G: a ring all-reduce sends 2(n-1)/n G
    for name in ("zero1-dp4-shard2", "zero2-dp4-shard2"):  # two replicas of a 2-rank shard: G/2 over 2 ranks
        for steps in runs[name].field("comm_bytes").values():
            assert steps[-1]["dp_replicate"] == pytest.approx(gradients / 2, rel=1e-3)
            assert "dp" not in steps[-1] or steps[-1]["dp"] == 0
    for steps in runs["zero3-dp2-shard1-cp2"].field("comm_bytes").values():  # shard = one dp rank x cp 2
        assert steps[-1]["dp_replicate"] == pytest.approx(gradients / 2, rel=1e-3)
