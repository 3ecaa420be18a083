"""ZeRO-R's constant-size fused communication buffers for ZeRO-2/3 (seed 004 lines 97-101, 219-221),
``parallel.fsdp_bucket_mb`` (``workers/parallel/data_parallel.py::fsdp_units``).

FSDP2 all-gathers and reduce-scatters each unit's parameters as one flat buffer; grouping consecutive blocks into
units of at most N MiB makes every block buffer one known size, at most N. Checked on 2 gloo ranks without Ray:
every all-gather and reduce-scatter a step issues, logged from the dispatcher, moves at most the bucket (the root
unit apart) and there are fewer of them; each bucket trains on the single-process curve (1e-4) at ZeRO-2 and
ZeRO-3 (with full recompute too); the in-step peak ``memory.measure`` sees grows by the gathered blocks a larger
unit holds at once (k - 1 blocks for a unit of k), and the planner's gathered term grows. Refused where there
are no units to group.
"""

from __future__ import annotations

import pytest
import torch

from orchestrator.planning.estimate import blocks_per_unit, estimate_rank
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import rank_ports, run_layouts, spawn_ranks
from tests.support.reference import reference_run
from tests.support.spec_errors import assert_actionable, spec_error
from workers.diagnostics.comm_bytes import _OPS, _tensor_bytes
from workers.model.gpt import GPT, lm_loss
from workers.model.registry import model_config
from workers.parallel.data_parallel import fsdp_units

STEPS = 3
LAYERS = 6
MODEL = {"n_layers": LAYERS, "d_model": 128, "d_ff": 512}  # blocks big enough to show in the in-step peak


def _block_bytes(spec) -> int:
    """One block's fp32 parameter bytes (every block of the tiny GPT is alike)."""
    gpt = GPT(model_config(spec.worker_dict()["model"]))
    return sum(p.numel() * 4 for p in gpt.layers["0"].parameters())


def _bucket_mb(spec, blocks: int) -> float:
    """A bucket that holds exactly ``blocks`` blocks (and a little to spare)."""
    return (blocks + 0.5) * _block_bytes(spec) / 2**20


def _spec(token_data, tmp_path, zero: int = 3, blocks: int | None = None, recompute: str = "none"):
    base = tiny_spec(token_data, tmp_path, model=MODEL)
    bucket = None if blocks is None else _bucket_mb(base, blocks)
    return tiny_spec(token_data, tmp_path, model=MODEL,
                     parallel={"dp": 2, "zero": zero, "fsdp_bucket_mb": bucket, "device": "cpu"},
                     memory={"recompute": recompute, "measure": True}, train={"steps": STEPS, "microbatches": 1})


def test_units_are_consecutive_blocks_within_the_bucket(token_data, tmp_path):
    spec = _spec(token_data, tmp_path)
    gpt = GPT(model_config(spec.worker_dict()["model"]))
    blocks = list(gpt.layers.values())
    assert fsdp_units(blocks, None) == [[b] for b in blocks]
    for per_unit in (1, 2, 4, LAYERS):
        units = fsdp_units(blocks, _bucket_mb(spec, per_unit))
        assert [b for unit in units for b in unit] == blocks
        assert [len(u) for u in units] == [per_unit] * (LAYERS // per_unit) + ([LAYERS % per_unit] if LAYERS %
                                                                              per_unit else [])
    # a bucket smaller than one block: each block alone; bf16 gathers: 1.5 fp32 blocks' bucket holds 3 bf16 ones
    assert [len(u) for u in fsdp_units(blocks, 0.001)] == [1] * LAYERS
    assert [len(u) for u in fsdp_units(blocks, _bucket_mb(spec, 1), torch.bfloat16)] == [3, 3]


def _logged_collectives(rank, ports, world, bucket, results):
    """One forward and backward of the tiny GPT under ZeRO-3 on ``world`` gloo ranks with ``bucket``: every
    all-gather's and reduce-scatter's buffer bytes, as the dispatcher sees them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.support.parity_harness import gloo_dp_mesh
    from workers.parallel.data_parallel import apply_data_parallel

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = _OPS.get(func._opname) if func.namespace in ("c10d", "_c10d_functional") else None
            if op is not None and op[0] in ("all_gather", "reduce_scatter"):
                big = op[0] == "reduce_scatter"  # its input is the whole buffer; an all-gather's is 1/world
                self.calls.append((op[0], _tensor_bytes(args[op[1]]) * (1 if big else world)))
            return func(*args, **(kwargs or {}))

    mesh = gloo_dp_mesh(rank, ports, world)
    torch.manual_seed(0)
    gpt = GPT(model_config({**MODEL, "n_heads": 4, "seq_len": 32, "vocab_size": 256}))
    apply_data_parallel(gpt, list(gpt.layers.values()), mesh, 3, bucket_mb=bucket)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(rank))
    with Log() as log:
        lm_loss(gpt(tokens), tokens).backward()
    results.put((rank, log.calls))


@pytest.mark.parametrize("per_unit", [1, 2, 3])
def test_each_buffer_is_at_most_one_bucket(per_unit, token_data, tmp_path):
    spec = _spec(token_data, tmp_path)
    block, bucket = _block_bytes(spec), _bucket_mb(spec, per_unit)
    calls = spawn_ranks(_logged_collectives, (rank_ports(1), 2, bucket), 2, 120)[0]
    gpt = GPT(model_config(spec.worker_dict()["model"]))
    root = sum(p.numel() * 4 for n, p in gpt.named_parameters() if not n.startswith("layers."))
    units = LAYERS // per_unit
    gathers = [b for k, b in calls if k == "all_gather"]
    scatters = [b for k, b in calls if k == "reduce_scatter"]
    # ZeRO-3 gathers every unit in forward and again in backward, and reduce-scatters each once; the block units'
    # buffers are all one size, per_unit blocks, within the bucket; the root unit (embeddings, head) is apart
    assert sorted(gathers) == sorted([per_unit * block] * 2 * units + [root] * 2)
    assert sorted(scatters) == sorted([per_unit * block] * units + [root])
    assert per_unit * block <= bucket * 2**20 < (per_unit + 1) * block


BUCKETS = {"one": (3, None, "none"), "two": (3, 2, "none"), "all": (3, LAYERS, "none"),
           "two-recompute": (3, 2, "full"), "zero2-all": (2, LAYERS, "none")}


@pytest.fixture(scope="module")
def runs(token_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("buckets")
    specs = [_spec(token_data, tmp / n, *s).worker_dict() for n, s in BUCKETS.items()]
    return dict(zip(BUCKETS, run_layouts(specs, 2, STEPS), strict=True))


@pytest.mark.parametrize("name", list(BUCKETS))
def test_each_bucket_trains_on_the_single_process_curve(name, runs, token_data, tmp_path):
    losses, grad_norms = reference_run(tiny_spec(token_data, tmp_path, model=MODEL,
                                                 train={"steps": STEPS, "microbatches": 1}), STEPS)
    assert runs[name].losses == pytest.approx(losses, rel=1e-4)
    assert runs[name].grad_norms == pytest.approx(grad_norms, rel=1e-4)


@pytest.mark.parametrize("name", ["two", "all"])
def test_a_larger_unit_raises_the_peak_by_the_blocks_it_gathers(name, runs, token_data, tmp_path):
    """Measured: the peak (in backward, as the last unit's saved tensors come back) holds one unit gathered, so a
    unit of k blocks raises it by k - 1 blocks' parameters. The planner's gathered term (a unit computed and one
    prefetched) grows with the unit too."""
    spec = _spec(token_data, tmp_path, *BUCKETS[name])
    base = _spec(token_data, tmp_path, *BUCKETS["one"])
    per_unit = blocks_per_unit(spec)
    assert per_unit == BUCKETS[name][1]
    measured = runs[name].memory[0]["step_peak"] - runs["one"].memory[0]["step_peak"]
    assert measured == pytest.approx((per_unit - 1) * _block_bytes(spec), rel=0.01)
    predicted = estimate_rank(spec, 0).state.gathered - estimate_rank(base, 0).state.gathered
    assert predicted > 0


REFUSED = [({"zero": 1}, {}, "parallel.zero", 1, "parallel.zero: 2 or 3"),
           ({"zero": 3, "fsdp_prefetch": 2}, {}, "parallel.fsdp_prefetch", 2, "remove one of"),
           ({"zero": 3}, {"offload": {"optimizer": True, "params": True}}, "memory.offload.params", True,
            "remove one of")]


@pytest.mark.parametrize(("parallel", "memory", "field", "value", "fix"), REFUSED)
def test_refused_where_units_are_not_grouped(parallel, memory, field, value, fix, token_data, tmp_path):
    raw = {"model": {"d_model": 32, "n_layers": 4, "n_heads": 4, "d_ff": 64, "seq_len": 32},
           "data": {"path": str(token_data)}, "run_dir": str(tmp_path / "run"),
           "parallel": {"device": "cpu", "dp": 2, "fsdp_bucket_mb": 1.0, **parallel}, "memory": memory}
    assert_actionable(spec_error(raw), field, value, fix)
