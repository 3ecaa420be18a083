"""Run one rank's training in a fresh interpreter to measure its memory without the test process's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def peak_memory_probe(spec, path: Path) -> dict:
    """Train ``spec`` for 3 steps in a fresh process and return its losses and peak resident memory.

    A fresh process, so the peak is this run's own and not the pytest process's.
    """
    path.write_text(json.dumps(spec.worker_dict()))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "workers.peak_memory_run", str(path), "3"],
                         env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
