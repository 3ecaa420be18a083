"""The GPU benchmark's logic that runs only on a GPU, checked here without one (nor torchtitan): reading
torchtitan's step log, the raymesh/torchtitan ratios, the job handed to torchtitan 0.2 and 0.3, and how the
abort check reads what happened to its survivor.

The log lines are written here in the shape torchtitan 0.2/0.3's ``MetricsProcessor.log`` prints them: colour
codes between the fields, thousands separators in tps, MFU in percent (``N/A`` under float8 on 0.3).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.gpu_abort import outcome
from benchmarks.gpu_torchtitan import command, parse_steps, skipped, summarize, with_ratios
from benchmarks.torchtitan_job import float8_settings

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 has no TOML reader; pip vendors one
    from pip._vendor import tomli as tomllib

RED, BLUE, RESET = "\x1b[31m", "\x1b[34m", "\x1b[39m"


def line(step: int, tps: int, mfu: str) -> str:
    return (f"[rank0]:[titan] 2026-11-24 15:00:00,000 - root - INFO - {RED}step: {step:2}  loss: 10.12345  "
            f"grad_norm:  1.2345  memory: 20.10GiB(25.40%)  {BLUE}tps: {tps:,}  tflops: 412.50  mfu: {mfu}{RESET}")


LOG = "\n".join(["some start-up line", line(1, 1000, "10.00%"), line(2, 40000, "40.00%"), "other line",
                 line(3, 60000, "60.00%")])


def test_step_lines_are_read_through_colour_codes_and_separators():
    steps = parse_steps(LOG)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[1] == {"step": 2, "tokens_per_s": 40000.0, "tflops": 412.5, "mfu": 0.4}
    assert parse_steps(line(4, 5, "N/A"))[0]["mfu"] is None


def test_warm_up_steps_are_left_out_and_steps_weigh_by_time():
    figures = summarize(parse_steps(LOG), warmup=1)
    assert figures["tokens_per_s"] == pytest.approx(2 / (1 / 40000 + 1 / 60000))  # = 48,000: tokens / seconds
    assert figures["mfu"] == pytest.approx(2 / (1 / 0.4 + 1 / 0.6))
    assert summarize(parse_steps(LOG), warmup=3) == {"tokens_per_s": None, "mfu": None}


def test_a_small_models_zero_mfu_reads_as_zero():
    # torchtitan 0.2.2's own line on torch 2.11 (a 107k-parameter model, run on a CPU): 24-bit colour codes
    # between the fields, MFU rounded to 0.00 %
    colour = "\x1b[38;2;180;60;0m"
    real = (f"[titan] 2026-11-28 23:35:35,318 - root - INFO - {RED}step:  {{}}  \x1b[32mloss:  6.15821  {colour}"
            f"grad_norm:  1.0335  {colour}memory: -0.00GiB(-0.00%)  {BLUE}tps: {{}}  \x1b[36mtflops: 0.00  "
            f"\x1b[35mmfu: 0.00%{RESET}")
    steps = parse_steps("\n".join(real.format(step, tps) for step, tps in ((1, 847), (2, 1840), (3, 1966))))
    assert [(s["step"], s["tokens_per_s"], s["mfu"]) for s in steps] == [(1, 847, 0), (2, 1840, 0), (3, 1966, 0)]
    assert summarize(steps, warmup=1) == {"tokens_per_s": pytest.approx(2 / (1 / 1840 + 1 / 1966)), "mfu": 0.0}


def test_ratios_use_raymeshs_formula_on_both_sides():
    raymesh = {"tokens_per_s": 24000.0, "mfu": 0.3, "model_flops_per_token": 1e10, "peak_flops": 1e15}
    titan = {**skipped("x"), "tokens_per_s": 48000.0, "mfu": 0.5, "reason": None}
    out = with_ratios(raymesh, titan)
    assert out["mfu_same_formula"] == pytest.approx(1e10 * 48000 / 1e15)
    assert out["ratio"] == pytest.approx({"tokens_per_s": 0.5, "mfu": 0.6, "mfu_same_formula": 0.3 / 0.48})
    assert with_ratios(raymesh, skipped("not importable"))["ratio"] is None


JOB = {"d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "d_ff": 8192, "vocab_size": 128256,
       "seq_len": 2048, "tie_embeddings": True, "global_batch_size": 8, "precision": "bf16", "recompute": "full",
       "steps": 13, "dataset_dir": "/d", "tokenizer_dir": "/t", "dump_folder": "/o"}


def test_torchtitan_0_3_gets_our_config_function_and_0_2_a_toml_job_importing_our_flavour(tmp_path):
    assert command("0.3.0", tmp_path, JOB)[-4:] == ["--module", "benchmarks.torchtitan_job", "--config",
                                                     "raymesh_job"]
    cmd = command("0.2.2", tmp_path, JOB)
    assert cmd[-2] == "--job.config_file"
    toml = tomllib.loads(Path(cmd[-1]).read_text())
    assert toml["model"] == {"name": "llama3", "flavor": "raymesh", "hf_assets_path": "/t"}
    assert toml["training"] == {"local_batch_size": 8, "seq_len": 2048, "steps": 13, "dataset": "c4_test",
                                "dataset_path": "/d", "mixed_precision_param": "bfloat16"}
    assert toml["activation_checkpoint"] == {"mode": "full"}
    assert toml["experimental"] == {"custom_import": "benchmarks.torchtitan_job"}
    assert toml["checkpoint"] == {"enable": False} and toml["metrics"] == {"log_freq": 1}


def test_abort_outcomes_read_as_what_happened():
    refused = outcome("cuda", {}, 20.0, {"formation_failed": "DistBackendError: Duplicate GPU detected"}, 0)
    assert not refused["group_formed"] and refused["summary"] == ("group did not form: DistBackendError: "
                                                                  "Duplicate GPU detected")
    torn_down = outcome("cuda", {}, 20.0, {"formed": 2.0, "entering": 1.0, "killed_at": 2.0}, -6)
    assert torn_down["group_formed"] and not torn_down["collective_failed"] and not torn_down["survivor_alive"]
    assert torn_down["summary"] == "survivor torn down inside the collective (exit code -6), no error raised"
    failed = {"at": 23.0, "in_collective_s": 22.0, "kind": "peer_lost", "detail": "DistBackendError: NCCL"}
    died = outcome("cuda", {}, 20.0, {"formed": 2.0, "killed_at": 2.0, "failed": failed}, -6)
    assert died["failed_after_kill_s"] == 21.0 and died["within_timeout"] and not died["reformed_ok"]
    assert died["summary"] == "collective failed 21.00s after the kill, as peer_lost; survivor did not re-form " \
                              "(exit code -6)"
    ok = outcome("cuda", {}, 20.0, {"formed": 2.0, "killed_at": 2.0, "failed": failed, "reformed": 2.0,
                                     "replacement_reduced": 2.0}, 0)
    assert ok["reformed_ok"] and ok["survivor_alive"] and ok["backend"] == "nccl"


def test_a_float8_job_turns_torchtitans_float8_converter_on_with_the_head_left_out(tmp_path):
    toml = tomllib.loads(Path(command("0.2.2", tmp_path, {**JOB, "float8": "rowwise"})[-1]).read_text())
    assert toml["model"]["converters"] == ["float8"]
    assert toml["float8"] == {"recipe_name": "rowwise", "filter_fqns": ["output", "lm_head"],
                              "enable_fsdp_float8_all_gather": False}
    assert float8_settings({**JOB, "float8": "tensorwise"})["enable_fsdp_float8_all_gather"]
    plain = tomllib.loads(Path(command("0.2.2", tmp_path, JOB)[-1]).read_text())
    assert "float8" not in plain and "converters" not in plain["model"] and float8_settings(JOB) == {}
