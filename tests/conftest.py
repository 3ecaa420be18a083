"""Session fixtures: one real Ray cluster (``ray start --head``) and one small token corpus per session.

Nothing imports this file; helpers the tests share live in ``tests/support``.

Starting Ray costs ~10 s here, so every test that trains joins the same head
node; it is a real cluster with a dashboard, so ``ray job submit`` tests use it
too. It runs with Ray's default authentication: Ray 2.60's ``ray start --head``
turns token authentication on when the machine has a token, which any local
``ray.init()`` leaves in ``~/.ray/auth_token`` (here ``ray get-auth-token
--generate`` makes sure of it); nothing sets ``RAY_AUTH_MODE``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from workers.data import prepare_data

RAY_CPUS = 8
DASHBOARD_PORT = 8265
GCS_PORT = 6389


@pytest.fixture(autouse=True)
def _torch_threads_as_found():
    """Each test leaves torch's intra-op thread count as it found it. Why: ``PSShard`` sets the process's count to
    1 (right in its own actor process), and the unit tests build shards in the test session's process: every
    later test then ran on one thread, so a test computed (and rounded) differently alone and in the suite."""
    torch = sys.modules.get("torch")  # imported by collection already; this file itself does not need it
    threads = torch.get_num_threads() if torch else None
    yield
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def token_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~50K byte tokens of the stdlib's json package: big enough for 40 steps without repeats."""
    out = tmp_path_factory.mktemp("tokens")
    prepare_data([Path(sysconfig.get_paths()["stdlib"]) / "json"], out)
    return out


@pytest.fixture(scope="session")
def heldout_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Byte tokens of the stdlib's html package (~97K: 2,945 windows of 33): text the tiny jobs never train on,
    their ``eval.path``."""
    out = tmp_path_factory.mktemp("heldout")
    prepare_data([Path(sysconfig.get_paths()["stdlib"]) / "html"], out)
    return out


@pytest.fixture(scope="session")
def bpe_token_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The json package as ids of a BPE trained on it (``bpe:4096``, as examples/bpe_pretrain.yaml prepares)."""
    out = tmp_path_factory.mktemp("bpe-tokens")
    prepare_data([Path(sysconfig.get_paths()["stdlib"]) / "json"], out, tokenizer="bpe:4096")
    return out


@pytest.fixture(scope="session")
def sft_pairs_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/sft's prompt/completion pairs, prepared as examples/sft_lora.yaml says (completions alone scored)."""
    out = tmp_path_factory.mktemp("sft-pairs")
    prepare_data([Path(__file__).parents[1] / "examples" / "sft"], out, format="prompt-completion")
    return out


@pytest.fixture(scope="session")
def dpo_pairs_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/dpo's preference pairs, prepared as examples/dpo_lora.yaml says (padded to its model.seq_len 96)."""
    out = tmp_path_factory.mktemp("dpo-pairs")
    prepare_data([Path(__file__).parents[1] / "examples" / "dpo"], out, format="preference", seq_len=96)
    return out


@pytest.fixture(scope="session")
def ray_cluster():
    """A head node started the way users start one; the test process joins it as a driver."""
    import ray

    from orchestrator.api.auth import use_ray_token_if_present

    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}  # a user's shell: Ray's defaults
    subprocess.run(["ray", "stop", "--force"], capture_output=True, env=env)
    subprocess.run(["ray", "get-auth-token", "--generate"], check=True, capture_output=True, env=env)
    started = subprocess.run(
        ["ray", "start", "--head", f"--num-cpus={RAY_CPUS}", f"--port={GCS_PORT}",
         "--include-dashboard=true", f"--dashboard-port={DASHBOARD_PORT}", "--disable-usage-stats",
         # Ray's log monitor rescans the session's log folder ten times a second to forward worker output to
         # drivers; raymesh's drivers never take it (``log_to_driver=False``), and with the suite's hundreds of
         # worker logs the rescans cost ~150 s of CPU over a run
         "--include-log-monitor=false"],
        check=True, capture_output=True, text=True, env=env,
    )
    assert "Token authentication is enabled" in started.stdout + started.stderr, "the head runs without Ray's auth"
    address = f"127.0.0.1:{GCS_PORT}"
    os.environ.pop("RAY_AUTH_MODE", None)
    use_ray_token_if_present()  # what raymesh's own entry points do before ray.init(address=...)
    ray.init(address=address, log_to_driver=False)
    yield {"address": address, "dashboard": f"http://127.0.0.1:{DASHBOARD_PORT}", "env": env}
    ray.shutdown()
    subprocess.run(["ray", "stop", "--force"], capture_output=True, env=env)
