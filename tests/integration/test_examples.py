"""Every job file in examples/ runs for a few steps, through the CLI, and its loss is finite and falls."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from orchestrator.cli import main

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
# examples whose data is not the byte corpus, and the fixture that prepares theirs as their comment says
DATA = {"bpe_pretrain": "bpe_token_data"}


@pytest.mark.parametrize("job", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(job, ray_cluster, request, tmp_path):
    summary = tmp_path / "summary.json"
    data = request.getfixturevalue(DATA.get(job.stem, "token_data"))
    rc = main(["run", str(job), "--no-progress", "--summary-json", str(summary),
               "--set", f"data.path={data}", "--set", f"run_dir={tmp_path / 'run'}",
               "--set", "train.steps=4", "--set", "checkpoint.every=2", "--set", "metrics.port=0"])
    assert rc == 0
    result = json.loads(summary.read_text())
    assert result["steps"] == 4 and len(result["losses"]) == 4
    assert all(math.isfinite(x) for x in result["losses"])
    assert result["losses"][-1] < result["losses"][0]
    assert [Path(p).name for p in result["checkpoints"]] == ["step-00000002", "step-00000004"]
    for key in ("final_loss", "tokens_per_s", "layout", "recoveries", "peak_memory_bytes"):
        assert key in result
