"""The GPU benchmark's reading of torchtitan's step log and the raymesh/torchtitan ratios (no torchtitan needed).

The log lines are written here in the shape torchtitan 0.3's ``MetricsProcessor.log`` prints them: colour codes
between the fields, thousands separators in tps, MFU in percent (``N/A`` under float8).
"""

from __future__ import annotations

import pytest

from benchmarks.gpu_torchtitan import parse_steps, skipped, summarize, with_ratios

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


def test_ratios_use_raymeshs_formula_on_both_sides():
    raymesh = {"tokens_per_s": 24000.0, "mfu": 0.3, "model_flops_per_token": 1e10, "peak_flops": 1e15}
    titan = {**skipped("x"), "tokens_per_s": 48000.0, "mfu": 0.5, "reason": None}
    out = with_ratios(raymesh, titan)
    assert out["mfu_same_formula"] == pytest.approx(1e10 * 48000 / 1e15)
    assert out["ratio"] == pytest.approx({"tokens_per_s": 0.5, "mfu": 0.6, "mfu_same_formula": 0.3 / 0.48})
    assert with_ratios(raymesh, skipped("not importable"))["ratio"] is None
