"""Every job file in examples/ runs for a few steps and its loss is finite and falls.

Examples whose feature lives in the controller or the CLI (checkpoint policy, control API, evaluation and
keep_best, trackers, faults, metrics, buckets, parameter-server shards, the profiled pipeline split, Hugging Face
import and export) run through ``raymesh run`` on the session's Ray cluster. The others change only what the
ranks compute (model, layout, schedule, precision, optimizer, memory): each is loaded by the CLI's own loader
with the same ``--set`` overrides, passes the checks ``raymesh run`` makes before starting Ray, and trains its own
layout in the Ray-free harness, where the examples of one world size share one spawn of rank processes. Why: a
rank process costs ~5 s of CPU to start here, and the path from ``raymesh run`` to the ranks is the same for all
of them (test_job_submit.py runs gpt_tiny_3d through ``raymesh submit``, the README's recipe).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from orchestrator.checkpoints import checksums
from orchestrator.cli import main
from orchestrator.runtime.ray_runtime import RayRuntime
from orchestrator.spec import load_spec
from tests.support.hf import save_hf_family, save_hf_gpt2, save_hf_llama
from tests.support.parity_harness import ran, run_grouped

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
# examples that need the controller or the CLI (see the docstring); the rest train in the harness
THROUGH_RAY = {"checkpoint_resume", "control_api", "evaluation", "experiment_tracking", "fault_injection",
               "hang_diagnosis", "keep_training", "hf_any_zero3", "llama_finetune_lora", "qwen3_finetune",
               "qwen3_moe_finetune",
               "memory_measured", "monitoring", "object_storage", "parameter_server",
               "parameter_server_bsp_tp", "parameter_server_compression", "parameter_server_ssp_pipeline",
               "pp_auto_split", "snapshot_compression", "soak"}
RAY_EXAMPLES = [p for p in EXAMPLES if p.stem in THROUGH_RAY]
RANK_EXAMPLES = [p for p in EXAMPLES if p.stem not in THROUGH_RAY]
STEPS = 4
# examples whose data is not the byte corpus, and the fixture that prepares theirs as their comment says
DATA = {"bpe_pretrain": "bpe_token_data", "sft_lora": "sft_pairs_data", "dpo_lora": "dpo_pairs_data"}
# examples training on a mixture (data.mix), and the fixtures that prepare its sources in order (two byte corpora:
# the json and html packages), each kept at the example's own weight
MIX_DATA = {"data_mix": ["token_data", "heldout_data"]}
# examples scoring a held-out loss (eval.path), and the fixture that prepares their held-out text
EVAL_DATA = {"evaluation": "heldout_data"}
# examples reading a Hugging Face checkpoint get one made here (tiny, random, transformers' save_pretrained)
NEEDS_HF_DIR = {"llama_finetune_lora": save_hf_llama, "hf_any_zero3": save_hf_gpt2,
                "qwen3_finetune": lambda directory: save_hf_family(directory, "qwen3", vocab_size=256),
                "qwen3_moe_finetune": lambda directory: save_hf_family(directory, "qwen3_moe", vocab_size=256)}
# examples whose settings do not fit 4 steps here (too slow at full size, a warm-up longer than the run), and what
# the test overrides (the layout stays theirs)
SHORTER = {"long_context": ["--set", "model.seq_len=1024"],  # 8192 tokens at cp=4: ~50 s a step on 2 busy cores
           # PowerSGD's 10-step warm-up would cover all 4 steps (the spec refuses that): 2 plain, 2 compressed
           "grad_compression": ["--set", "parallel.powersgd_warmup_steps=2"],
           # a full fine-tune's rate for 0.6B weights barely moves a random 256-token model in 4 steps (its loss
           # stays at ln 256, where noise decides the sign of the change)
           "qwen3_finetune": ["--set", "optim.lr=3e-3"], "qwen3_moe_finetune": ["--set", "optim.lr=3e-3"]}
# examples that lose ranks on purpose keep their warm spare; the others run without one (a spare is a process
# importing torch after step 1, ~5 s of CPU on this 2-core machine, and none of them loses a rank)
KEEP_SPARES = {"fault_injection", "hang_diagnosis", "hf_any_zero3", "keep_training", "snapshot_compression", "soak"}
# examples whose drill kills rank 1 within the test's steps: the summary must show its recovery
KILLS_RANK_1 = {"hf_any_zero3", "keep_training", "snapshot_compression"}
# examples whose run_dir (and so checkpoints) is a bucket: here a file:// URL (the same URL path through the real
# job); the ranks of the session's cluster cannot see an S3 server's credentials, so test_object_storage.py covers S3
URL_CHECKPOINTS = {"object_storage"}


def test_every_controller_side_example_still_exists():
    """A renamed example named in THROUGH_RAY would otherwise move to the harness without anyone noticing."""
    assert not THROUGH_RAY - {p.stem for p in EXAMPLES}


@pytest.fixture(scope="module")
def rank_runs(request, tmp_path_factory):
    """Each rank-side example as ``raymesh run`` would load it (same overrides), checked as it checks before Ray,
    then trained for STEPS steps by the harness, its final state saved where its checkpoints would go."""
    tmp = tmp_path_factory.mktemp("examples")
    specs, saves = {}, {}
    for job in RANK_EXAMPLES:
        sets = [_data_override(job, request), f"run_dir={tmp / job.stem / 'run'}", f"train.steps={STEPS}",
                "metrics.port=0", *SHORTER.get(job.stem, [])[1::2]]
        spec = load_spec(job, sets)
        RayRuntime().preflight(spec)  # what `raymesh run` checks before it starts Ray
        specs[job.stem] = spec
        saves[job.stem] = str(tmp / job.stem / "final")
    return run_grouped(specs, checkpoints=saves), saves


def _data_override(job: Path, request) -> str:
    """The ``--set`` pointing the example at the test's prepared data: ``data.path``, or for a mixture each
    ``data.mix`` entry's path (the example's weights kept)."""
    if job.stem not in MIX_DATA:
        return f"data.path={request.getfixturevalue(DATA.get(job.stem, 'token_data'))}"
    weights = [entry["weight"] for entry in yaml.safe_load(job.read_text())["data"]["mix"]]
    paths = [request.getfixturevalue(name) for name in MIX_DATA[job.stem]]
    return "data.mix=[" + ", ".join(f"{{path: '{p}', weight: {w}}}" for p, w in zip(paths, weights, strict=True)) + "]"


@pytest.mark.parametrize("job", RANK_EXAMPLES, ids=[p.stem for p in RANK_EXAMPLES])
def test_rank_side_example_trains_its_layout(job, rank_runs):
    runs, saves = rank_runs
    run = ran(runs, job.stem)
    assert len(run.losses) == STEPS and all(math.isfinite(x) for x in run.losses)
    assert run.losses[-1] < run.losses[0]
    assert checksums.problem(saves[job.stem]) is None  # every rank's shard of a loadable checkpoint


@pytest.mark.parametrize("job", RAY_EXAMPLES, ids=[p.stem for p in RAY_EXAMPLES])
def test_example_runs(job, ray_cluster, request, tmp_path):
    summary = tmp_path / "summary.json"
    data = request.getfixturevalue(DATA.get(job.stem, "token_data"))
    make_hf = NEEDS_HF_DIR.get(job.stem)
    extra = ["--set", f"model.init_from={make_hf(tmp_path / 'hf')}"] if make_hf else []
    extra += SHORTER.get(job.stem, [])
    if job.stem not in KEEP_SPARES:
        extra += ["--set", "fault_tolerance.warm_spares=false"]
    if job.stem in EVAL_DATA:  # scored at both checkpoints (keep_best needs every checkpoint scored)
        extra += ["--set", f"eval.path={request.getfixturevalue(EVAL_DATA[job.stem])}", "--set", "eval.every=2"]
    if job.stem in URL_CHECKPOINTS:
        extra += ["--set", f"run_dir=file://{tmp_path / 'run'}"]
    rc = main(["run", str(job), "--no-progress", "--summary-json", str(summary),
               "--set", f"data.path={data}", "--set", f"run_dir={tmp_path / 'run'}",
               "--set", f"train.steps={STEPS}", "--set", "checkpoint.every=2", "--set", "metrics.port=0", *extra])
    assert rc == 0
    result = json.loads(summary.read_text())
    assert result["steps"] == STEPS and len(result["losses"]) == STEPS
    assert all(math.isfinite(x) for x in result["losses"])
    assert result["losses"][-1] < result["losses"][0]
    assert [Path(p).name for p in result["checkpoints"]] == ["step-00000002", "step-00000004"]
    for key in ("final_loss", "tokens_per_s", "layout", "recoveries", "peak_memory_bytes"):
        assert key in result
    if job.stem in KILLS_RANK_1:
        assert [r["rank"] for r in result["recoveries"]] == [1], result["recoveries"]
    if job.stem == "keep_training":  # the other replicas stepped while rank 1 was rebuilt, then it rejoined
        assert result["recoveries"][0]["degraded_steps"][0] == 3, result["recoveries"]
    if job.stem == "pp_auto_split":  # the profiled split reached the ranks through Ray and the summary
        split = result["layout"]["pp_split"]
        assert sum(split) == 6 and split[0] > split[1], split  # blocks moved off the heavy head's stage
    if job.stem == "parameter_server":  # a shard joined and left mid-run (ssp, gRPC): workers paused, rerouted
        assert [(r["at_step"], r["shards_to"]) for r in result["ps_resizes"]] == [(2, 3), (4, 2)], result["ps_resizes"]
        reads = [json.loads(line) for line in (tmp_path / "run" / "ps_reads.jsonl").read_text().splitlines()]
        assert any(r["shard"] == 2 for r in reads)  # the removed shard's reads are kept
        assert max(r["clock"] - r["min_applied"] for r in reads) <= 1  # the example's staleness bound held
    if job.stem in EVAL_DATA:  # scored at steps 2 and 4; keep_best names the checkpoint with the lower loss
        held = {e["step"]: e["loss"] for e in result["eval_losses"]}
        assert list(held) == [2, 4] and all(math.isfinite(x) for x in held.values())
        best = min(held, key=held.get)
        assert result["best_checkpoint"] == {"step": best, "eval_loss": held[best],
                                             "path": str(tmp_path / "run" / "checkpoints" / f"step-{best:08d}")}
    if job.stem == "hang_diagnosis":  # found by the deadline, every rank's stacks in the run dir before the kill
        (rec,) = result["recoveries"]
        assert rec["kind"] == "hang" and rec["at_step"] == 4
        assert all("in run_window" in (Path(rec["stacks"]) / f"rank{r}.txt").read_text() for r in (0, 1))
    if job.stem == "llama_finetune_lora":  # a LoRA run: its adapters folded into a Hugging Face directory
        _merged_export_loads_in_transformers(job, tmp_path, [*extra, "--set", f"run_dir={tmp_path / 'run'}"])
    if job.stem == "experiment_tracking":
        _trackers_match_the_summary(tmp_path / "run", result)


def _trackers_match_the_summary(run_dir: Path, summary: dict) -> None:
    """Each tracker, read back by its own library, holds the run's per-step losses and grad norms and its
    recovery count (written by the controller in its actor, not by this process)."""
    from tests.support.tracker_records import mlflow_series, tensorboard_series, wandb_series

    steps = list(range(1, summary["steps"] + 1))
    for key, values in (("loss", summary["losses"]), ("grad_norm", summary["grad_norms"])):
        assert mlflow_series(run_dir, "raymesh", key) == list(zip(steps, values, strict=True)), key
        assert wandb_series(run_dir, key) == list(zip(steps, values, strict=True)), key
        read = tensorboard_series(run_dir / "tensorboard", key)
        assert [s for s, _ in read] == steps and [v for _, v in read] == pytest.approx(values, rel=1e-6), key
    assert wandb_series(run_dir, "recoveries")[-1] == (summary["steps"], len(summary["recoveries"]))


def _merged_export_loads_in_transformers(job: Path, tmp_path: Path, sets: list[str]) -> None:
    """`export-merged --format hf` of the fine-tune's last checkpoint: a directory transformers loads, whose
    logits differ from the base checkpoint's (the adapters trained and were folded in)."""
    import torch
    from transformers import LlamaForCausalLM

    out = tmp_path / "merged"
    assert main(["export-merged", str(job), "--format", "hf", "--out", str(out), *sets]) == 0
    merged, base = (LlamaForCausalLM.from_pretrained(d) for d in (out, tmp_path / "hf"))
    tokens = torch.arange(32)[None]
    with torch.no_grad():
        assert not torch.allclose(merged(tokens).logits, base(tokens).logits)
