"""A sliding-window Mistral (``model.sliding_window`` from its config.json) trains as ``transformers`` computes it
and as the single-process reference does, at seq_len 4x its window, on cp2 ring and tp2 (issue 50), without Ray
(tests/support/parity_harness.py; fp32, CPU).

The checkpoint is made here with ``transformers`` (random weights, an 8-token window; the tiny job's 32-token
sequences). Each layout's first step (loss, global gradient norm) must equal ``transformers``' MistralForCausalLM on
the same batch (1e-5), and its steps the single-process reference (1e-4); the window must matter: the same
checkpoint without it gives another first loss.
"""

from __future__ import annotations

import json

import pytest

from tests.support.hf import assert_first_step_then_reference, save_hf_family, transformers_first_step
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped

STEPS = 3
WINDOW = 8  # the tiny job's seq_len 32 is 4x the window; cp2's zigzag chunks are 8 tokens
LAYOUTS = {"cp2-ring": {"cp": 2, "cp_impl": "ring"}, "tp2": {"tp": 2}}
SHAPE = {"intermediate_size": 64}  # the tiny job's d_ff


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_hf_family(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=WINDOW, **SHAPE)


@pytest.fixture(scope="module")
def specs(hf_dir, token_data, tmp_path_factory):
    return {name: tiny_spec(token_data, tmp_path_factory.mktemp(name), parallel={**parallel, "device": "cpu"},
                            model={"init_from": str(hf_dir)}, train={"steps": STEPS})
            for name, parallel in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs(specs):
    return run_grouped(specs)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_windowed_mistral_matches_transformers_and_the_reference(name, specs, runs, hf_dir):
    spec = specs[name]
    assert spec.model.sliding_window == WINDOW and spec.model.seq_len == 4 * WINDOW
    assert_first_step_then_reference(ran(runs, name), spec, hf_dir, STEPS)


def test_the_window_changes_the_first_step(specs, hf_dir, tmp_path):
    """The same weights without the window give another first loss: the parity above is the window's."""
    config = json.loads((hf_dir / "config.json").read_text())
    unwindowed = tmp_path / "unwindowed"
    unwindowed.mkdir()
    for item in hf_dir.iterdir():
        (unwindowed / item.name).symlink_to(item)
    (unwindowed / "config.json").unlink()
    (unwindowed / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    windowed, _ = transformers_first_step(specs["tp2"], hf_dir)
    plain, _ = transformers_first_step(specs["tp2"], unwindowed)
    assert abs(windowed - plain) > 1e-4 * abs(plain)
