"""ZeRO-R's partitioned activation checkpoints (Pa, seed 004 lines 97-101 and 215-222), ``memory.partition_activations``
(workers/parallel/partitioned_activations.py).

At tp=2 without sequence parallelism every block input full recompute stores is the same on both tp ranks. Through
the Ray-free parity harness (2 gloo ranks), each setting trains on the single-process curve (1e-4), and the probe's
count of what stays stored for backward (``memory.measure``) falls by exactly half an input per block with
``device`` (each rank keeps its half), and by a whole input per block with ``host``, whose halves it counts in host
memory instead; ``sqrt`` segments keep one half input per segment. The planner's estimate follows each. Settings
where nothing is replicated over tp to split are refused before start, naming field, value and fix. On 4 ranks,
Pa beside FSDP2's hooks (tp=2 × dp=2 ZeRO-3) and in a pipeline with host slices in one buffer (tp=2 × pp=2) stays
on the curve; the buffer itself (``Arena``) is checked in one process.
"""

from __future__ import annotations

import pytest
import torch

from orchestrator.planning.estimate import estimate_rank
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts
from tests.support.reference import reference_run
from tests.support.spec_errors import assert_actionable, spec_error
from workers.parallel.partitioned_activations import InputSlices

STEPS = 3
LAYERS = 4
SETTINGS = {  # name: (memory.recompute, memory.partition_activations)
    "whole": ("full", "none"), "device": ("full", "device"), "host": ("full", "host"),
    "sqrt-whole": ("sqrt", "none"), "sqrt-device": ("sqrt", "device"), "contiguous": ("full", "device", True),
}


def _spec(token_data, tmp_path, recompute: str, place: str, contiguous: bool = False, tp: int = 2):
    return tiny_spec(token_data, tmp_path, model={"n_layers": LAYERS},
                     parallel={"tp": tp, "sequence_parallel": False, "device": "cpu"},
                     memory={"recompute": recompute, "partition_activations": place, "measure": True,
                             "contiguous_checkpoints": contiguous},
                     train={"steps": STEPS, "microbatches": 1})


@pytest.fixture(scope="module")
def runs(token_data, tmp_path_factory):
    """Every setting trained for ``STEPS`` steps at tp=2, all in one spawn of 2 ranks."""
    tmp = tmp_path_factory.mktemp("pa")
    specs = [_spec(token_data, tmp / n, *s).worker_dict() for n, s in SETTINGS.items()]
    return dict(zip(SETTINGS, run_layouts(specs, 2, STEPS), strict=True))


def _input_bytes(spec) -> int:
    """One block input of one microbatch: fp32 [batch, seq, d_model], the same on both tp ranks."""
    return 4 * spec.train.global_batch_size * spec.model.seq_len * spec.model.d_model


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_setting_trains_on_the_single_process_curve(name, runs, token_data, tmp_path):
    losses, grad_norms = reference_run(_spec(token_data, tmp_path, "none", "none", tp=1), STEPS)
    assert runs[name].losses == pytest.approx(losses, rel=1e-4)
    assert runs[name].grad_norms == pytest.approx(grad_norms, rel=1e-4)


def test_each_rank_stores_half_of_every_block_input(runs, token_data, tmp_path):
    spec = _spec(token_data, tmp_path, "full", "device")
    whole, half = _input_bytes(spec), _input_bytes(spec) // 2
    for rank in (0, 1):
        base = runs["whole"].memory[rank]
        device, host = runs["device"].memory[rank], runs["host"].memory[rank]
        assert base["activations"] - device["activations"] == LAYERS * (whole - half)
        assert device["activations_host"] == 0
        assert base["activations"] - host["activations"] == LAYERS * whole  # none of it on the device
        assert host["activations_host"] == LAYERS * half
        assert "activations_host" not in base
        segments = LAYERS // 2  # sqrt: round(√4) = 2 blocks a segment, one stored input each
        sqrt_base, sqrt = runs["sqrt-whole"].memory[rank], runs["sqrt-device"].memory[rank]
        assert sqrt_base["activations"] - sqrt["activations"] == segments * (whole - half)
        # contiguous: the same bytes (the slices are 512-byte multiples), in one buffer
        assert runs["contiguous"].memory[rank]["activations"] == device["activations"]


@pytest.mark.parametrize("name", ["whole", "device", "host", "sqrt-whole", "sqrt-device"])
def test_the_planner_predicts_what_stays_on_the_device(name, runs, token_data, tmp_path):
    """The memory model's activation bytes move with the setting as the measured ones do."""
    spec = _spec(token_data, tmp_path, *SETTINGS[name])
    base = _spec(token_data, tmp_path, SETTINGS[name][0], "none")
    predicted = estimate_rank(base, 0).activation_bytes - estimate_rank(spec, 0).activation_bytes
    measured = runs[name.replace("device", "whole").replace("host", "whole")].memory[0]["activations"] \
        - runs[name].memory[0]["activations"]
    assert predicted == measured


REFUSED = [  # (memory, parallel, the field named, its value, a fix part)
    ({"recompute": "selective", "partition_activations": "device"}, {"tp": 2, "sequence_parallel": False},
     "memory.recompute", "selective", "memory.recompute: full or sqrt"),
    ({"recompute": "full", "partition_activations": "device"}, {"tp": 1},
     "parallel.tp", 1, "memory.partition_activations: host"),
    ({"recompute": "full", "partition_activations": "device"}, {"tp": 2},
     "parallel.sequence_parallel", True, "sequence_parallel: false"),
    ({"recompute": "full", "contiguous_checkpoints": True}, {"tp": 2, "sequence_parallel": False},
     "memory.contiguous_checkpoints", True, "memory.partition_activations: device or host"),
]


@pytest.mark.parametrize(("memory", "parallel", "field", "value", "fix"), REFUSED)
def test_refused_where_nothing_replicated_is_stored(memory, parallel, field, value, fix, token_data, tmp_path):
    raw = {"model": {"d_model": 32, "n_layers": 4, "n_heads": 4, "d_ff": 64, "seq_len": 32},
           "data": {"path": str(token_data)}, "run_dir": str(tmp_path / "run"),
           "parallel": {"device": "cpu", **parallel}, "memory": memory}
    assert_actionable(spec_error(raw), field, value, fix)


def test_slices_after_the_first_round_are_cut_from_one_buffer():
    """The arena (``memory.contiguous_checkpoints``), one process: the first microbatch's slices are allocated one
    by one and size the buffer; every later microbatch's come from it (one storage, in order, the padding
    zeroed), each gathered back exactly; a bigger round overflows into its own allocations and grows it."""
    slices = InputSlices(None, "device", contiguous=True)
    inputs = [torch.randn(3, 5, 7, requires_grad=True) for _ in range(4)]

    def round_trip(xs):
        kept = [slices.keep(x) for x in xs]
        for x, k in zip(xs, kept, strict=True):
            back = slices.whole(k, x.device)
            assert torch.equal(back, x.detach()) and back.requires_grad
        return kept

    round_trip(inputs)
    assert slices.allocations == 4
    kept = round_trip(inputs)
    assert slices.allocations == 5  # the buffer, once
    storages = {k.part.untyped_storage().data_ptr() for k in kept}
    assert storages == {slices.arena.buffer.untyped_storage().data_ptr()}
    assert [k.part.data_ptr() for k in kept] == sorted(k.part.data_ptr() for k in kept)
    round_trip(inputs + inputs[:1])  # one more than the buffer holds: its own allocation
    assert slices.allocations == 6
    round_trip(inputs + inputs[:1])  # the buffer grown to the bigger round
    assert slices.allocations == 7
    round_trip(inputs)
    assert slices.allocations == 7


WIDER = {  # 4 ranks: Pa beside FSDP2's hooks, and with several microbatches in flight in a pipeline (the arena)
    "zero3-tp2": ({"dp": 2, "zero": 3}, {"partition_activations": "device"}),
    "pp2-tp2-host-contiguous": ({"pp": 2}, {"partition_activations": "host", "contiguous_checkpoints": True}),
}


def test_pa_on_zero3_and_pipeline_layouts_trains_on_the_curve(token_data, tmp_path):
    def spec(parallel, memory):
        return tiny_spec(token_data, tmp_path, parallel={"tp": 2, "sequence_parallel": False, "device": "cpu",
                                                         **parallel},
                         memory={"recompute": "full", **memory}, train={"steps": STEPS, "microbatches": 2})

    losses, grad_norms = reference_run(tiny_spec(token_data, tmp_path, train={"steps": STEPS, "microbatches": 2}),
                                       STEPS)
    runs = run_layouts([spec(*layout).worker_dict() for layout in WIDER.values()], 4, STEPS)
    for run in runs:
        assert run.losses == pytest.approx(losses, rel=1e-4)
        assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4)
