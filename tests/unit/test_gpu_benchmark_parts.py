"""``benchmarks/gpu.py``'s bookkeeping for a device lease, on a CPU: a part that fails is recorded and the others
still run, the report so far is on disk after each part, and the abort check names NCCL's refusal of two ranks on
one GPU (what an H200 answered) instead of passing its bare error on."""

from __future__ import annotations

import json

from benchmarks.gpu import Part, markdown
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
