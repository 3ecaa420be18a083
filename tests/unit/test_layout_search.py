"""The time-and-memory planner: its fast path equals the spec estimate, its formulas are the published ones,
identical ranks are estimated once, and the published Megatron and Llama 3 layouts fit with headroom."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrator import JobSpec
from orchestrator.planning import comm_model as cm
from orchestrator.planning import estimate as est
from orchestrator.planning import layout_search as ls
from orchestrator.planning import memory_model as mm
from orchestrator.planning import time_model as tm
from orchestrator.planning.layout_picker import pick_layout
from orchestrator.planning.published import RUNS
from orchestrator.planning.snapshot_memory import snapshot_bytes
from orchestrator.spec import load_spec
from workers.diagnostics.memory_probe import ActivationMeter
from workers.model.gpt import lm_loss
from workers.model.registry import build_model, model_config

GPT = {"d_model": 64, "n_layers": 4, "n_heads": 4, "d_ff": 128, "seq_len": 32}
ROOT = Path(__file__).resolve().parents[2]
LLAMA = {"arch": "llama", "d_model": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_ff": 96, "seq_len": 32}


def _job(model: dict, **sections) -> JobSpec:
    return JobSpec.from_dict({"data": {"path": "/tmp/none"}, "run_dir": "/tmp/none", "model": model, **sections})


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("parallel, train, recompute, dtype", [
    ({"dp": 2, "zero": 2}, {"microbatches": 4}, "none", "bf16"),
    ({"dp": 4, "zero": 3}, {"microbatches": 1}, "full", "fp32"),
    ({"dp": 4, "zero": 3, "fsdp_prefetch": 3}, {"microbatches": 2}, "selective", "bf16"),
    ({"dp": 2, "tp": 2, "zero": 0}, {"microbatches": 2}, "selective", "bf16"),
    ({"dp": 4, "zero": 1}, {"microbatches": 1}, "none", "fp32"),
    ({"pp": 2, "dp": 2, "zero": 3, "pp_schedule": "interleaved_1f1b"}, {"microbatches": 4}, "none", "bf16"),
    ({"pp": 4, "tp": 2, "pp_schedule": "gpipe"}, {"microbatches": 8}, "full", "fp32"),
    ({"dp": 2, "cp": 2, "zero": 3}, {"microbatches": 2}, "none", "bf16"),
    ({"cp": 2, "zero": 0}, {"microbatches": 2}, "none", "fp32"),
    ({"dp": 2, "cp": 2, "zero": 1, "cp_impl": "allgather"}, {"microbatches": 1}, "none", "fp32"),
    ({"cp": 2, "zero": 3}, {"microbatches": 1}, "none", "fp32"),
    # train.compile: inductor's blocks and the compiled whole-logits loss (memory_model's compiled terms)
    ({"dp": 2, "zero": 2}, {"microbatches": 2, "compile": True}, "none", "bf16"),
    ({"dp": 4, "zero": 3}, {"microbatches": 1, "compile": True}, "full", "bf16"),
])
def test_search_path_equals_the_spec_estimate(model, parallel, train, recompute, dtype):
    """Where both apply (layers divide the stages, no LoRA), the search's arithmetic is the estimate's."""
    spec = _job(model, parallel={**parallel, "device": "cuda"}, train={"global_batch_size": 16, **train},
                memory={"recompute": recompute}, precision={"dtype": dtype})
    ev = ls.Evaluator(ls.Shape.of(spec), tm.gpu("H100"))
    layout = ls.layout_of(spec)
    for pp_rank in range(spec.parallel.pp):
        rank = spec.parallel.grid.rank_of(pp=pp_rank)
        assert ev.rank_peak(layout, pp_rank) == est.estimate_rank(spec, rank).total_bytes, pp_rank


def test_accumulation_and_pipelines_hold_full_gradients_and_stages():
    """FSDP2 keeps full-size gradients until the last microbatch; a pipeline keeps its stage gathered."""
    n = 1000
    plain = mm.model_state(n, 4, 2, fsdp=True)
    accumulating = mm.model_state(n, 4, 2, fsdp=True, accumulating=True)
    assert plain.step_grads == 4 * n // 4 and accumulating.step_grads == 4 * n
    zero3 = mm.model_state(n, 4, 3, fsdp=True, zero3_gathered_params=100)
    staged = mm.model_state(n, 4, 3, fsdp=True, zero3_gathered_params=100, pipelined=True)
    assert zero3.gathered == 4 * 100 and staged.gathered == 4 * n


def test_autocast_saves_one_copy_of_the_norm_output_per_linear():
    """Measured on the model under bf16 autocast: q, k, v (and SwiGLU's gate and up) cast their input apart."""
    spec = _job({**LLAMA, "n_layers": 2}, train={"global_batch_size": 4, "microbatches": 1},
                precision={"dtype": "bf16"})
    torch.manual_seed(0)
    model = build_model(model_config(spec.worker_dict()["model"]))
    tokens = torch.randint(0, 256, (4, 32))
    with ActivationMeter([model], []) as meter, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(model(tokens), tokens)
    loss.backward()
    predicted = sum(est.layer_bytes(spec, i) for i in range(2)) + est.head_bytes(spec) \
        + est.autocast_copy_bytes(spec, sum(est.stage_params(spec, 0, 1)))
    assert abs(predicted - meter.peak) <= 0.01 * meter.peak, (predicted, meter.peak)


def test_collective_formulas():
    phi = 1e9
    assert cm.all_reduce(phi, 8) == pytest.approx(2 * 7 / 8 * phi)
    assert cm.reduce_scatter(phi, 8) == cm.all_gather(phi, 8) == pytest.approx(7 / 8 * phi)
    shape = cm.CommShape(phi, phi, 1e6, 2e6, 3e5, 4e6, blocks=10, moe_blocks=5, top_k=2, boundaries=2)
    b = cm.step_bytes(shape, dp=64, tp=4, pp=4, cp=2, ep=8, zero=3, microbatches=1)
    assert b["dp"] == pytest.approx(3 * 127 / 128 * phi)  # ZeRO-3: 3Φ (reduce-scatter + two all-gathers) over dp·cp
    assert cm.step_bytes(shape, dp=64, zero=0)["dp"] == pytest.approx(cm.all_reduce(phi, 64))
    assert b["tp"] == pytest.approx(10 * 4 * cm.all_reduce(1e6, 4) + cm.all_gather(4e6, 4))  # logits: gathered once
    # ring at cp=2: K/V one hop forward and one backward, the dK/dV accumulator one hop (cp-1) to the owner
    assert b["pp"] == 2e6 * 2 and b["cp"] == 10 * 3 * (2 - 1) * 3e5
    assert b["ep"] == pytest.approx(5 * 4 * 7 / 8 * 2 * 1e6)


def test_time_model_adds_the_schedules_bubble():
    g = tm.gpu("A100")
    t = tm.step_time(312e12, {}, g, {"pp": 4}, microbatches=8, virtual_stages=2, efficiency=0.5)
    assert t.compute == pytest.approx(2.0) and t.bubble == pytest.approx(2.0 * 3 / 16)


def test_uneven_split_keeps_first_and_last_stage_light():
    counts = ls.split_layers(126, 16)
    assert sum(counts) == 126 and counts[0] == counts[-1] == 7 and max(counts) == 8


def test_identical_ranks_are_estimated_once(monkeypatch):
    """16,384 ranks: one estimate per pipeline coordinate; the search: at most three per candidate."""
    spec = _job({"preset": "llama3-70b"}, parallel={"tp": 8, "pp": 8, "dp": 256, "device": "cuda"},
                precision={"dtype": "bf16"}, train={"global_batch_size": 2048, "microbatches": 8})
    calls = []
    real = est.estimate_rank
    monkeypatch.setattr(est, "estimate_rank", lambda s, r: calls.append(r) or real(s, r))
    rows = est.estimate(spec)
    assert len(rows) == 16384 and len(calls) == 8
    assert [r.rank for r in rows] == list(range(16384)) and rows[-1].total_bytes == real(spec, 16383).total_bytes
    run = RUNS["llama3-405b"]
    result = ls.search(run.shape, run.gpus, tm.gpu(run.gpu))
    assert result.rank_estimates <= 3 * result.considered


@pytest.mark.parametrize("parallel", [
    {"pp": 4, "dp": 2, "tp": 2}, {"pp": 2, "dp": 4, "zero": 3, "pp_schedule": "interleaved_1f1b"},
    {"pp": 4, "cp": 2, "pp_schedule": "gpipe", "pp_split": [1, 3, 3, 1]},  # two middle stages peak alike
])
def test_the_largest_rank_is_read_off_one_estimate_per_pipeline_coordinate(parallel):
    """``peak_rank``, the snapshot size and ``render``'s rank per stage, from ``stage_estimates``, are what every
    rank's estimate gives: the same rank (the lowest of equal peaks), coordinates and bytes."""
    spec = _job({**GPT, "n_layers": 8, "vocab_size": 64}, parallel={**parallel, "device": "cuda"},
                train={"global_batch_size": 16, "microbatches": 4}, precision={"dtype": "bf16"})
    every = est.estimate(spec)
    firsts = [r for r in every if r.coords["dp"] == r.coords["tp"] == r.coords.get("cp", 0) == 0]
    assert est.stage_estimates(spec) == firsts and len(firsts) == spec.parallel.pp  # render's one per stage
    assert est.peak_rank(spec) == max(every, key=lambda r: r.total_bytes)
    assert snapshot_bytes(spec) == max(r.state.params + r.state.optimizer + r.state.offloaded + r.feedback_bytes
                                       for r in every)


@pytest.mark.parametrize("key", list(RUNS))
def test_published_layouts_fit_with_headroom(key):
    """The published degrees, with the planner's best ZeRO stage, micro-batch and recompute, fit in 90% of
    80 GB; the planner's own choice fits by construction and is no slower than the published layout."""
    run = RUNS[key]
    result = ls.search(run.shape, run.gpus, tm.gpu(run.gpu))
    published = [c for c in result.best if all(getattr(c.layout, k) == v for k, v in run.degrees.items())]
    assert published, f"{run.name}: the published layout does not fit"
    assert published[0].peak <= 0.9 * 80e9 and result.best[0].step_s <= published[0].step_s


def test_predicted_bytes_of_a_job_spec():
    """What the communication measurement puts "predicted" beside: per pp rank, per mesh dimension."""
    spec = _job(GPT, parallel={"dp": 4, "zero": 0}, train={"global_batch_size": 16, "microbatches": 2})
    params = sum(est.stage_params(spec, 0, 1))
    bytes_ = ls.predicted_bytes(spec)
    assert list(bytes_) == [0] and bytes_[0]["dp"] == pytest.approx(cm.all_reduce(4 * params, 4))
    assert bytes_[0]["tp"] == bytes_[0]["pp"] == 0
    piped = ls.predicted_bytes(_job(GPT, parallel={"pp": 2, "tp": 2}, train={"global_batch_size": 16,
                                                                             "microbatches": 4}))
    hidden = 4 * 4 * 32 * 64 // 2  # fp32 b·s·h of a 4-sequence microbatch, sequence-sharded over tp=2
    # per microbatch stage 0 sends the hidden state forward, stage 1 its gradient back: one send each
    assert piped[0]["pp"] == piped[1]["pp"] == 4 * hidden and piped[0]["tp"] > 0


def test_picker_shards_over_context_parallel_ranks_as_the_ranks_do():
    """ZeRO shards (and ZeRO-0/1 reduce) over dp x cp, the workers' ``data_parallel_mesh``; the
    search used dp alone and left out the ring kernel's buffers. Llama 3 8B at 32K tokens, one sequence a step on
    8 GPUs of 170 GB, so dp=1: the picker chose dp=1 cp=8 zero=0, priced at 145.58 GB within the 153 GB limit,
    which the ranks (and the estimate ``raymesh run`` checks) put at 177.80 GB: (4 + 4 + 8) · 8,030,261,248 of
    replicated state, replicate()'s unsharded fp32 copy (32.1 GB) and autocast's bf16 one (16.1 GB) on top.
    ZeRO over the eight cp ranks (16 bytes · 8.03e9 / 8 = 16.06 GB of state) was never offered."""
    spec = _job({"preset": "llama3-8b", "seq_len": 32768}, precision={"dtype": "bf16"},
                train={"global_batch_size": 1, "microbatches": 1}, memory={"recompute": "full"})
    choice = pick_layout(spec, nodes=1, gpus_per_node=8, gpu_mem=170 * 10**9)
    assert choice.candidate.peak == est.peak_rank(choice.spec).total_bytes <= choice.result.limit
    ev = ls.Evaluator(ls.Shape.of(spec), tm.gpu("H100"))
    zero3 = est.estimate_rank(spec.with_overrides(["parallel.cp=8", "parallel.zero=3"]), 0)
    assert zero3.state.persistent == 16 * 8_030_261_248 // 8
    assert ev.rank_peak(ls.Layout(1, 1, 1, 8, 3, 1, "full"), 0) == zero3.total_bytes
    assert any(lay.zero == 3 for lay in ls.candidates(ls.Shape.of(spec), 8, tm.gpu("H100"), cps=[8]))


def test_planning_16384_gpus_considers_and_picks_what_it_did(monkeypatch):
    """``raymesh plan`` of Llama 3 405B at 8K tokens on 2,048 nodes x 8 H200 (the README's timing): the layouts
    the search prices, the rank estimates and refusals it counts, and what it picks, for the search the picker
    runs (cp=1 below 16K tokens) and the unrestricted one beside it. Making the search faster (cached rank
    terms, the capped split program) must not change one of them: ``plan`` prints them all."""
    spec = load_spec(ROOT / "examples/mixed_precision_bf16.yaml",
                     ["model.preset=llama3-405b", "model.seq_len=8192", "train.global_batch_size=2048"])
    results = []
    search = ls.search
    monkeypatch.setattr(ls, "search", lambda *a, **kw: results.append(search(*a, **kw)) or results[-1])
    choice = pick_layout(spec, nodes=2048, gpus_per_node=8, gpu_type="H200")
    picked, free = results
    assert (picked.considered, picked.rank_estimates, free.considered, free.rank_estimates) == (162, 9367, 5189, 185173)
    assert picked.rejected == {"global batch not divisible by dp": 6, "too few microbatches for the schedule": 113,
                               "layers do not split into the stages": 4, "does not fit with headroom": 112}
    assert free.rejected == {"global batch not divisible by dp": 10, "too few microbatches for the schedule": 678,
                             "layers do not split into the stages": 20, "does not fit with headroom": 3362}
    assert [c.layout.label() for c in picked.best[:3]] == [
        "dp=2048 tp=8 pp=1 cp=1 zero=2 mbs=1 recompute=full", "dp=2048 tp=8 pp=1 cp=1 zero=3 mbs=1 recompute=full",
        "dp=512 tp=8 pp=4 cp=1 zero=2 mbs=1 recompute=full interleaved_1f1bx2 split=15,16,16,16,16,16,16,15"]
    assert choice.candidate is picked.best[0] and len(picked.best) == 162 - 112 and len(free.best) == 5189 - 3362
    assert choice.unrestricted.layout.label() == (
        "dp=8 tp=8 pp=32 cp=8 zero=2 mbs=1 recompute=none interleaved_1f1bx2 split=" + ",".join(["1"] + ["2"] * 62
                                                                                              + ["1"]))
