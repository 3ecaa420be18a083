"""The job-file fuzzer (tests/support/spec_fuzz.py): every mutation of a valid job is accepted or refused with a
message naming the field; none gives a traceback or hangs, and none of a known-bad class is accepted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.spec_fuzz import BUGS, fuzz, summary


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return fuzz(tmp_path_factory.mktemp("fuzz"), seed=13)


def test_every_mutation_is_accepted_or_refused_by_name(outcomes):
    counts = summary(outcomes)
    print(f"{len(outcomes)} mutations: {dict(counts)}")
    bugs = [(o.verdict, o.mutation.name, o.mutation.sets, o.detail.strip().splitlines()[-1:]) for o in outcomes
            if o.verdict in BUGS]
    assert not bugs, bugs
    assert len(outcomes) >= 500
    assert counts["refused"] > counts["accepted"] > 0  # the generator reaches both outcomes


def test_known_bad_classes_are_all_present(outcomes):
    names = [o.mutation.name for o in outcomes]
    for cls in ("=inf", "=nan", "=bool", "=numeric-string", "=fraction", "bogus", "moved to", "duplicate",
                "non-UTF-8", "binary file", "--set"):
        assert sum(cls in n for n in names) >= 1, cls
    assert sum(o.mutation.known_bad for o in outcomes) >= 300


def test_fuzz_is_deterministic(tmp_path):
    from tests.support.spec_fuzz import mutations

    a = mutations(tmp_path / "d", tmp_path / "r", seed=5)
    b = mutations(tmp_path / "d", tmp_path / "r", seed=5)
    assert [(m.name, m.data, m.sets) for m in a] == [(m.name, m.data, m.sets) for m in b]


def test_the_cli_refuses_a_damaged_job_file_without_a_traceback(tmp_path):
    """One real `raymesh plan` process: the in-process fuzz calls the same `main`, this proves the entry point."""
    job = tmp_path / "job.yaml"
    job.write_bytes(b"data:\n  path: data\ntrain:\n  steps: 10\n  steps: \xff20\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "plan", str(job)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "is not UTF-8 text: byte 47 (line 5)" in proc.stderr and "fix: save the job file as UTF-8" in proc.stderr
