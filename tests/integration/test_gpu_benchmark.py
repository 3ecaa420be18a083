"""``benchmarks/gpu.py`` on a CPU with a tiny Llama: the command issue 19's GPU lease will run, checked here.

One run of the script (2 timed steps after 1 warm-up, the profiled steps, the abort check over gloo), no Ray.
Its JSON is checked against what it must equal: MFU recomputed from the record with 6·N + 12·L·d·s FLOPs per
token, N counted on ``transformers``' Llama of the same shape; the planner's in-step peak of the same spec;
and the abort check's outcome on gloo (the survivor fails at once as ``peer_lost`` and re-forms its group).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.planning.estimate import estimate_rank
from orchestrator.spec import JobSpec

ROOT = Path(__file__).resolve().parents[2]
TINY = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "vocab_size": 256, "seq_len": 32}
BATCH, STEPS, WARMUP = 2, 2, 1
CPU_PEAK_FLOPS = 0.1e12  # the nominal CPU peak the README documents for MFU off a GPU


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-bench")
    sets = [f"model.{k}={v}" for k, v in TINY.items()] + [f"train.global_batch_size={BATCH}"]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--steps", str(STEPS),
           "--warmup", str(WARMUP), "--trace", str(tmp / "trace"), "--check-abort", "--abort-timeout-s", "10",
           "--markdown", str(tmp / "table.md"), "--variant", "memory.recompute=none",
           *(a for s in sets for a in ("--set", s))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), tmp


def transformers_parameters() -> int:
    """The tiny model's parameter count by an implementation raymesh did not write."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=TINY["vocab_size"], hidden_size=TINY["d_model"], intermediate_size=TINY["d_ff"],
                      num_hidden_layers=TINY["n_layers"], num_attention_heads=TINY["n_heads"],
                      num_key_value_heads=TINY["n_kv_heads"], tie_word_embeddings=True)
    return sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())


def test_every_field_is_there(run):
    report, _ = run
    assert set(report) >= {"device", "torch", "job", "throughput", "memory", "torchtitan", "profile", "abort"}
    assert set(report["throughput"]) >= {"tokens", "step_s", "tokens_per_s", "wall_tokens_per_s", "mfu", "hfu",
                                         "model_flops_per_token", "peak_flops", "per_step"}
    assert set(report["memory"]) >= {"measured_peak_bytes", "predicted_peak_bytes", "relative_error", "source"}
    assert set(report["torchtitan"]) >= {"tokens_per_s", "mfu", "mfu_same_formula", "ratio", "reason"}
    assert report["device"] == "cpu"
    assert len(report["throughput"]["per_step"]) == STEPS


def test_tokens_per_second_and_mfu_follow_from_the_step_records(run):
    t = run[0]["throughput"]
    assert t["tokens"] == STEPS * BATCH * TINY["seq_len"]
    assert t["tokens_per_s"] > 0 and t["wall_tokens_per_s"] > 0
    assert t["tokens_per_s"] == pytest.approx(t["tokens"] / t["step_s"], rel=1e-12)
    params = transformers_parameters()
    assert run[0]["job"]["parameters"] == params
    per_token = 6 * params + 12 * TINY["n_layers"] * TINY["d_model"] * TINY["seq_len"]  # PaLM's accounting
    assert 0 < t["mfu"] < 1
    assert t["mfu"] == pytest.approx(per_token * t["tokens"] / t["step_s"] / CPU_PEAK_FLOPS, rel=1e-9)
    assert t["hfu"] > t["mfu"]  # full recompute runs each forward twice


def test_the_prediction_is_the_planners_for_the_same_spec(run):
    m = run[0]["memory"]
    spec = JobSpec.from_dict({
        "model": {"preset": "llama-1b", **TINY}, "precision": {"dtype": "bf16"}, "memory": {"recompute": "full"},
        "train": {"global_batch_size": BATCH, "steps": WARMUP + STEPS + 2}, "parallel": {"device": "cpu"},
        "optim": {"name": "adamw"}, "data": {"path": "unused"}})
    assert m["predicted_peak_bytes"] == estimate_rank(spec, 0).total_bytes
    assert m["measured_peak_bytes"] > 0
    assert m["relative_error"] == pytest.approx((m["predicted_peak_bytes"] - m["measured_peak_bytes"])
                                                / m["measured_peak_bytes"])
    assert "VmHWM" in m["source"]


def test_the_abort_check_on_gloo_fails_the_survivor_at_once_and_it_reforms(run):
    abort = run[0]["abort"]
    (variant,) = abort["variants"]
    assert variant["backend"] == "gloo" and variant["group_formed"]
    assert variant["collective_failed"] and variant["error_kind"] == "peer_lost"
    assert variant["within_timeout"] and variant["failed_after_kill_s"] < 10
    assert variant["survivor_alive"] and variant["survivor_exit_code"] == 0
    assert variant["reformed_all_reduce"] == 2.0 and variant["reformed_ok"] and abort["ok"]


def test_the_trace_and_the_top_ops(run):
    report, tmp = run
    profile = report["profile"]
    trace = json.loads(gzip.decompress(Path(profile["trace"]).read_bytes()))
    assert trace["traceEvents"]
    assert 0 < len(profile["top_ops"]) <= 10
    assert all(row["self_us"] >= 0 and row["calls"] > 0 for row in profile["top_ops"])
    assert (tmp / "trace" / "top_ops.txt").read_text() == profile["table"]


def test_torchtitan_missing_or_off_an_accelerator_is_a_reason_not_a_crash(run):
    titan = run[0]["torchtitan"]
    assert titan["tokens_per_s"] is None and titan["mfu"] is None and titan["ratio"] is None
    assert "torchtitan" in titan["reason"]


def test_a_variant_trains_the_job_with_its_fields_changed(run):
    report, _ = run
    (variant,) = report["variants"]
    assert variant["overrides"][-1] == "memory.recompute=none"
    assert variant["job"]["recompute"] == "none" and report["job"]["recompute"] == "full"
    t = variant["throughput"]
    assert t["tokens"] == report["throughput"]["tokens"] and t["hfu"] == t["mfu"] > 0  # nothing recomputed
    assert variant["memory"]["predicted"]["activations"] > report["memory"]["predicted"]["activations"]


def test_the_markdown_table_names_the_figures(run):
    table = (run[1] / "table.md").read_text()
    for row in ("raymesh tokens/s", "raymesh MFU", "peak memory measured / predicted", "torchtitan", "abort check"):
        assert f"| {row}" in table
    assert "| job above |" in table and "| memory.recompute=none |" in table  # the variants' rows
    assert not math.isnan(run[0]["throughput"]["mfu"])
