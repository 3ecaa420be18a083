"""The README's submission recipe, run as written against the session's ``ray start --head`` (Ray's default
authentication: token auth on), and ``raymesh submit|status`` from a shell that knows nothing but Ray's token file."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from orchestrator import Client
from tests.support.jobs import wait_for

REPO = Path(__file__).parents[2]


def user_shell_env() -> dict[str, str]:
    """A fresh login shell's environment: no Ray mode or address chosen for it (HOME, so ~/.ray/auth_token, kept)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "RAYMESH_TOKEN"}


def readme_recipe() -> list[str]:
    """The commands of the README's ``ray job submit`` block, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    (block,) = [b for b in blocks if "ray job submit" in b]
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_readme_recipe_runs_an_example_on_a_head_with_token_authentication(ray_cluster, token_data, tmp_path):
    start, *submit = readme_recipe()
    assert start.startswith("ray start --head")  # the session's head is that node (started in conftest)
    summary = tmp_path / "summary.json"
    script = "\n".join(["set -e", *submit]).replace("/shared/data/stdlib", str(token_data))
    script = script.replace("/shared/runs/tiny", str(tmp_path / "run"))  # paths on this machine's "shared storage"
    script += f" --set train.steps=3 --set checkpoint.every=0 --summary-json {summary}"
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=user_shell_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout
    result = json.loads(summary.read_text())
    assert len(result["losses"]) == 3 and result["layout"]["world_size"] == 8
    without = subprocess.run(["bash", "-c", submit[-1]], cwd=REPO, capture_output=True, text=True, timeout=120,
                             env=user_shell_env())  # the recipe's export is what makes it work
    assert without.returncode != 0 and "Missing authentication token" in without.stdout + without.stderr


def raymesh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**user_shell_env(), "PYTHONPATH": str(REPO)})


def test_raymesh_submit_and_status_work_on_the_default_head(ray_cluster, token_data, tmp_path):
    # stopped, never finished: the run only has to outlast a `raymesh status` and a `raymesh stop`, CLI processes
    # of a second or more each, which 200 tiny steps need not do on a fast machine
    steps = 1000
    # 2 ranks: submit, status and stop do not depend on the grid
    overrides = [f"data.path={token_data}", f"run_dir={tmp_path / 'run'}", f"train.steps={steps}",
                 "checkpoint.every=0", "parallel.pp=1", "parallel.tp=1"]
    submitted = raymesh("submit", "examples/gpt_tiny_3d.yaml", *[a for o in overrides for a in ("--set", o)],
                        "--address", ray_cluster["dashboard"])
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    job_id = submitted.stdout.strip().splitlines()[-1]
    live = wait_for(lambda: (s := raymesh("status", job_id, "--address", ray_cluster["dashboard"])).returncode == 0
                    and ", step " in s.stdout and s, 300, "`raymesh status` to show a live step")
    assert "control API: 127.0.0.1:" in live.stdout  # through the loopback-only API, with Ray's token
    stopped = raymesh("stop", job_id, "--address", ray_cluster["dashboard"], "--reason", "enough")
    assert stopped.returncode == 0 and "the controller finishes" in stopped.stdout, stopped.stderr  # via the API
    client = Client(ray_cluster["dashboard"])
    assert client.wait(job_id, 300) == "succeeded", client.logs(job_id)[-3000:]  # the driver ended on its own
    assert "stopped" in raymesh("status", job_id, "--address", ray_cluster["dashboard"]).stdout
    ended = client.status(job_id)  # gracefully: it finished its step and wrote its summary
    assert ended["state"] == "stopped"
    assert 0 < len(ended["summary"]["losses"]) < steps
