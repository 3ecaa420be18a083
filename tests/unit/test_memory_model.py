"""The memory model reproduces the ZeRO paper's tables; the layout picker keeps headroom and explains itself.

Pure arithmetic, no Ray: measured-vs-predicted on real runs is tests/test_memory_measured.py.
"""

from __future__ import annotations

import pytest

from orchestrator.cli import main
from orchestrator.errors import SpecError
from orchestrator.planning import memory_model as mm
from orchestrator.planning.estimate import estimate, stage_params
from orchestrator.planning.layout_picker import pick_layout
from orchestrator.spec import JobSpec
from orchestrator.units import parse_bytes

PSI, N = 7_500_000_000, 64


@pytest.mark.parametrize("zero, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_table(zero, gb):
    """Ψ=7.5B, N=64, K=12: 120 GB / 31.4 GB / 16.6 GB / 1.9 GB (seed 004's table)."""
    state = mm.model_state(PSI, N, zero, precision="mixed", optimizer="adamw")
    assert round(state.peak / 1e9, 1) == gb
    assert mm.optimizer_state_bytes("adamw") + mm.PRECISIONS["mixed"][2] == 12  # the paper's K


def test_largest_trainable_model_on_80gb_gpus():
    """Seed 003's chart: DDP stays at ~3.5B whatever the GPU count; ZeRO-3 grows linearly with it."""
    gpus = [1, 4, 8, 16, 32, 64]
    ddp = [mm.max_trainable_params(80e9, n, zero=0) for n in gpus]
    zero3 = [mm.max_trainable_params(80e9, n, zero=3) for n in gpus]
    assert all(3.3e9 <= x <= 3.7e9 for x in ddp) and len(set(ddp)) == 1
    for n, x in zip(gpus, zero3):
        assert x == pytest.approx(n * zero3[0], rel=1e-6)
    assert zero3[-1] > 150e9  # the chart's ~175B at 64 GPUs, same order


def test_stages_precision_and_offload():
    base = mm.model_state(1000, dp=4, zero=0, precision="fp32")
    assert (base.params, base.grads, base.optimizer) == (4000, 4000, 8000)
    assert mm.model_state(1000, 4, 0, "autocast").persistent == base.persistent  # raymesh's bf16 keeps fp32 state
    fsdp2 = mm.model_state(1000, 4, 2, "fp32", fsdp=True)
    assert (fsdp2.params, fsdp2.grads, fsdp2.optimizer, fsdp2.gathered) == (1000, 1000, 2000, 4000)
    off = mm.model_state(1000, 4, 1, "mixed", offload_optimizer=True)
    assert off.optimizer == 0 and off.offloaded == 12 * 1000 // 4
    assert mm.model_state(1000, 1, 0, optimizer="paged_adamw").optimizer == 0
    inf = mm.model_state(1000, 4, 3, "fp32", fsdp=True, zero3_gathered_params=100, offload_params=True,
                         offload_optimizer=True)
    assert (inf.params, inf.optimizer, inf.gathered) == (0, 0, 400) and inf.offloaded == 1000 + 2000
    assert mm.model_state(1000, 1, 0, optimizer="sgd", momentum=True).optimizer == 4000


def test_in_flight_microbatches_per_schedule():
    assert mm.in_flight_microbatches("1f1b", 1, 0, 8) == 1
    assert mm.in_flight_microbatches("gpipe", 4, 3, 8) == 8
    assert [mm.in_flight_microbatches("1f1b", 4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert mm.in_flight_microbatches("interleaved_1f1b", 4, 0, 8, 2) == 11  # (v-1)p + 2(p-1) + 1


def test_recompute_and_sequence_parallel_shrink_activations():
    args = (2048, 1, 4096, 32, 16384)
    none, sel, full = (mm.layer_activation_bytes(*args, recompute=r, compute_bytes=2, attention="math")
                       for r in ("none", "selective", "full"))
    assert full < sel < none and full == 4 * 2048 * 4096
    tp, sp = (mm.layer_activation_bytes(*args, tp=8, sequence_parallel=s, compute_bytes=2) for s in (False, True))
    assert sp < tp < mm.layer_activation_bytes(*args, compute_bytes=2)


def test_activation_offload_keeps_two_layers_on_the_device():
    assert mm.device_activation_bytes(10_000, 300) == 10_000
    assert mm.device_activation_bytes(10_000, 300, offload_activations=True) == 600


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1.5e9") == 1_500_000_000
    with pytest.raises(ValueError, match="80GB"):
        parse_bytes("eighty")


def _spec(**sections) -> JobSpec:
    raw = {"data": {"path": "/absent/data"}, "model": {"d_model": 256, "n_layers": 8, "n_heads": 8, "seq_len": 256},
           "train": {"global_batch_size": 64, "microbatches": 64}}  # micro-batch 1, kept by the picker
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return JobSpec.from_dict(raw)


def test_tensor_parallel_ranks_add_up_to_the_model():
    spec = _spec(parallel={"tp": 2})
    total = sum(stage_params(spec, 0, 1))
    replicated = stage_params(spec, 0, 1)[1]
    assert sum(r.params for r in estimate(spec)) == total + replicated  # norms live on both tp ranks


def test_the_estimate_counts_the_vocabulary_rows_the_ranks_build():
    """tp=2 pads a 257-token vocabulary to 258 rows in the embedding and the head; the estimate counts them."""
    import torch

    from workers.model.registry import build_model
    from workers.spec import WorkerSpec

    spec = _spec(model={"vocab_size": 257}, parallel={"tp": 2})
    with torch.device("meta"):
        built = sum(p.numel() for p in build_model(WorkerSpec.from_dict(spec.worker_dict()).model).parameters())
    assert sum(stage_params(spec, 0, 1)) == built


def test_picker_prefers_plain_data_parallel_when_compute_hides_the_all_reduce():
    """A big batch: the gradient all-reduce hides under the last microbatch's backward, so no pipeline
    bubble or tensor-parallel traffic is worth paying for (the seeds' rule, now from the time model)."""
    choice = pick_layout(_spec(train={"global_batch_size": 4096, "microbatches": 1}), 2, 4, 10**12)
    p = choice.spec.parallel
    assert (p.dp, p.pp, p.tp) == (8, 1, 1) and "fastest of" in choice.reason


def test_picker_keeps_headroom_below_device_memory():
    """memory.headroom: a layout whose in-step peak passes (1 - headroom) of the GPU is refused."""
    spec = _spec()
    free = pick_layout(spec.with_overrides(["memory.headroom=0"]), 2, 4, 10**12)
    tight = int(free.candidate.peak / 0.95)  # the fastest fits the whole GPU but not 90% of it
    zero_headroom = pick_layout(spec.with_overrides(["memory.headroom=0"]), 2, 4, tight)
    assert zero_headroom.candidate.layout == free.candidate.layout
    picked = pick_layout(spec, 2, 4, tight)
    assert picked.candidate.layout != free.candidate.layout and picked.candidate.peak <= 0.9 * tight
    assert picked.candidate.step_s >= free.candidate.step_s


def test_picker_error_names_the_flag_value_and_fix():
    with pytest.raises(SpecError) as info:
        pick_layout(_spec(), 1, 2, 1000)
    assert info.value.field == "--gpu-mem" and "too small" in info.value.problem and "--gpu-mem" in info.value.fix


def test_picker_error_without_a_runnable_layout_counts_the_refusals_in_words():
    """Three GPUs split a batch of 2 no way (dp=3): the error printed the search's counters as a Python dict, under
    "raymesh plan" instead of the options' names."""
    with pytest.raises(SpecError) as info:
        pick_layout(_spec(model={"n_layers": 2}, train={"global_batch_size": 2, "microbatches": 1}), 1, 3, 10**12)
    assert str(info.value).startswith("option `--nodes/--gpus-per-node`: value '1x3' gives no layout this job can "
                                      "run (1 layout: global batch not divisible by dp); fix: pick a GPU count")


def test_plan_cli_picks_and_explains(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("data: {path: /absent/data}\nmodel: {d_model: 256, n_layers: 8, n_heads: 8, seq_len: 256}\n"
                   "train: {global_batch_size: 64, microbatches: 64}\n")
    assert main(["plan", str(job), "--nodes", "2", "--gpus-per-node", "4", "--gpu-mem", "80GB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("picked dp=") and "for 2 node(s) x 4 H100(s): fastest of" in out
    assert "why the others lost" in out and "run it: raymesh run" in out and "weights" in out
    assert "in-memory snapshots: 4 copies of up to" in out  # zero 2: the peer's replicas ship
    assert main(["plan", str(job), "--gpus-per-node", "2", "--gpu-mem", "1KB"]) == 2
    err = capsys.readouterr().err
    assert "--gpu-mem" in err and "too small" in err and "fix: use --gpu-mem" in err
    assert main(["plan", str(job), "--gpu-mem", "lots"]) == 2
    assert "is not a size" in capsys.readouterr().err
    assert main(["plan", str(job), "--set", "parallel.device_memory=1KB"]) == 0
    out = capsys.readouterr().out
    assert "does not fit: rank 0 needs" in out and "of host memory a rank, reserved with its placement" in out


def test_bad_device_memory_is_a_spec_error():
    with pytest.raises(SpecError) as info:
        _spec(parallel={"device_memory": "lots"})
    assert info.value.field == "parallel.device_memory" and "80GB" in info.value.fix
    assert _spec(parallel={"device_memory": "80GiB"}).parallel.device_memory_bytes == 80 * 2**30
