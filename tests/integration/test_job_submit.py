"""``ray job submit --working-dir . -- raymesh run examples/...`` against a real ``ray start --head`` cluster."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).parents[2]


def test_ray_job_submit_runs_an_example_to_completion(ray_cluster, token_data, tmp_path):
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        ["ray", "job", "submit", "--address", ray_cluster["dashboard"], "--working-dir", str(REPO), "--",
         "raymesh", "run", "examples/gpt_tiny_3d.yaml", "--no-progress",
         "--set", f"data.path={token_data}", "--set", f"run_dir={tmp_path / 'run'}",
         "--set", "train.steps=3", "--set", "checkpoint.every=0", "--summary-json", str(summary)],
        capture_output=True, text=True, timeout=600, env=ray_cluster["env"],
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout
    result = json.loads(summary.read_text())
    assert len(result["losses"]) == 3
    assert result["layout"]["world_size"] == 8
