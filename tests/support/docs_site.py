"""Building the documentation site as .ci/run does, for the tests that check it (strict build, browser search)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def build_site(out: Path, config: Path = REPO / "mkdocs.yml") -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of this checkout (or of ``config``) into ``out``: the command .ci/run runs."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                           "--site-dir", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
