"""``benchmarks/gpu.py``'s bookkeeping for a device lease, on a CPU: a part that fails is recorded and the others
still run, the report so far is on disk after each part, the abort check names NCCL's refusal of two ranks on
one GPU (what an H200 answered) instead of passing its bare error on, and issue 48's suite reads each setting
against the bf16 compiled job of the same run."""

from __future__ import annotations

import json

from benchmarks.gpu import SUITE_48, Part, markdown, parse_args, ratio_row, suite_ratios
from benchmarks.gpu_abort import outcome

H200_ERROR = ("DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, invalid usage "
              "(run with NCCL_DEBUG=WARN for details), NCCL version 2.28.9")


def test_a_failing_part_is_recorded_and_the_report_so_far_is_saved(tmp_path):
    out = tmp_path / "gpu.json"
    report = {"device": "cpu"}
    part = Part(str(out), report)
    failed = part("base", lambda: 1 / 0)
    assert "ZeroDivisionError" in failed["error"]
    report["torchtitan"] = part("torchtitan", lambda: {"tokens_per_s": 5.0})
    part.save()
    saved = json.loads(out.read_text())
    assert saved == {"device": "cpu", "torchtitan": {"tokens_per_s": 5.0}, "partial": True}


def test_the_table_says_which_part_failed():
    report = {"device": "NVIDIA H200", "torch": "2.11.0", "steps": 10, "warmup_steps": 3,
              "job": {"preset": "llama-1b", "arch": "llama", "d_model": 2048, "n_layers": 16, "seq_len": 2048,
                      "global_batch_size": 8, "precision": "bf16", "recompute": "full"},
              "throughput": None, "memory": None, "errors": {"base": "Traceback ...\nRuntimeError: CUDA out of memory"},
              "torchtitan": {"error": "Traceback ...\nOSError: no wheel"}, "abort": None,
              "variants": [{"variant": "train.compile=true", "error": "Traceback ...\nBackendCompilerFailed: x"}]}
    table = markdown(report)
    assert "| raymesh | failed: RuntimeError: CUDA out of memory |" in table
    assert "| torchtitan | failed: OSError: no wheel |" in table
    assert "| train.compile=true | failed: BackendCompilerFailed: x | | |" in table


def test_nccl_refusing_two_ranks_on_one_gpu_is_named():
    o = outcome("cuda", {}, 10.0, {"formation_failed": H200_ERROR}, 0)
    assert not o["group_formed"] and "two GPUs" in o["summary"] and "Duplicate GPU" in o["summary"]
    gloo = outcome("cpu", {}, 10.0, {"formation_failed": "RuntimeError: connection refused"}, 1)
    assert gloo["summary"] == "group did not form: RuntimeError: connection refused"


def _variant(name: str, tps: float | None, peak: int = 0, **extra) -> dict:
    """A measured variant of the suite as ``run`` records it (``tps`` None: the part failed)."""
    if tps is None:
        return {"variant": SUITE_48[name], "error": "Traceback ...\nRuntimeError: x"}
    return {"variant": SUITE_48[name], "throughput": {"tokens_per_s": tps, "mfu": tps / 1e5},
            "memory": {"measured_peak_bytes": peak, "relative_error": 0.01}, **extra}


def test_the_issue48_suite_adds_its_variants_once_and_reads_each_against_the_bf16_compiled_job():
    args = parse_args(["--suite", "issue48", "--variant", SUITE_48["bf16_state"]])
    assert sorted(args.variants) == sorted(SUITE_48.values())  # the one given by hand is not run twice
    picked = {"memory.recompute": {"value": "none", "why": "fits"}}
    titan = {"ratio": {"tokens_per_s": 1.05}}
    report = {"variants": [
        _variant("bf16_compiled", 60000.0, 40), _variant("float8_rowwise", 78000.0, 30, torchtitan=titan),
        _variant("float8_tensorwise", None), _variant("bf16_state", 60000.0, 36),
        _variant("offloaded_optimizer", 48000.0, 20), _variant("default_picked", 58000.0, 40, defaults_picked=picked)]}
    ratios = suite_ratios(report, ["issue48"])
    assert ratios["float8_rowwise"]["vs_bf16_compiled"] == 1.3 and ratios["float8_rowwise"]["vs_torchtitan"] == 1.05
    assert ratios["float8_rowwise"]["peak_vs_bf16_compiled"] == 0.75
    assert ratios["offloaded_optimizer"]["vs_bf16_compiled"] == 0.8
    assert ratios["float8_tensorwise"]["vs_bf16_compiled"] is None  # failed: no figure, not a zero
    assert ratios["default_picked"]["picked"] == picked and ratios["default_picked"]["mfu"] == 0.58
    assert suite_ratios(report, []) == {}
    assert "| float8_rowwise | 1.30 | 0.75 | +1.0% | 1.05 |" in ratio_row("float8_rowwise", ratios["float8_rowwise"])
    assert ratio_row("float8_tensorwise", ratios["float8_tensorwise"]) == "| float8_tensorwise | - | - | - | - |"
