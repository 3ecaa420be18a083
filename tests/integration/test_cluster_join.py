"""Which Ray cluster ``raymesh run`` joins with no ``--address`` and no ``RAY_ADDRESS``: the head ``ray start
--head`` runs on this machine, else a local Ray of its own; never another program's private ``ray.init()``, whose
jobs died when that program exited.

Each test runs ``cluster.connect`` (what ``raymesh run`` calls) in a fresh process, as the test process is already
a driver of the session's cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from orchestrator.events import parse_event
from tests.support.driver import REPO

GCS_PORT = 6389  # tests/conftest.py's head

CONNECT = ("import ray\nfrom orchestrator.runtime import cluster\ncluster.connect(None, 1)\n"
           "print(ray.get_runtime_context().gcs_address)\nray.shutdown()\n")


def env_without_address() -> dict:
    """A user's shell with no ``RAY_ADDRESS``; Ray's token mode is what the machine's token makes it."""
    return {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1"}


def connected() -> tuple[str, dict]:
    """(the GCS address ``cluster.connect(None, ...)`` joined, the fields of its ``event=cluster`` line)."""
    done = subprocess.run([sys.executable, "-c", CONNECT], env=env_without_address(), cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    events = [parse_event(line) for line in done.stderr.splitlines()]
    fields = [fields for name, fields in filter(None, events) if name == "cluster"]
    assert len(fields) == 1, done.stderr
    return done.stdout.strip().splitlines()[-1], fields[0]


@pytest.fixture
def private_ray():
    """Another program's own local Ray (``ray.init(address="local")``: a private instance even while a
    ``ray start`` head runs), alive until the test ends; (its GCS address, the program's pid)."""
    program = subprocess.Popen(
        [sys.executable, "-c", "import sys, ray\nray.init(address='local', num_cpus=1, include_dashboard=False)\n"
         "print(ray.get_runtime_context().gcs_address, flush=True)\nsys.stdin.read()\nray.shutdown()\n"],
        env=env_without_address(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = program.stdout.readline().strip()
        assert address, "the private ray.init() did not start"
        yield address, program.pid
    finally:
        program.stdin.close()
        program.wait(timeout=120)


def test_another_program_s_private_ray_is_not_joined(private_ray):
    """Whether or not a ``ray start`` head runs too (the session's, when other tests started it), the private
    instance is passed over and the event line says so; with no head, this process starts one of its own."""
    address, pid = private_ray
    joined, fields = connected()
    assert joined != address
    assert fields["address"] == joined and fields["found_by"] in ("ray start", "started"), fields
    assert f"{address} (the private ray.init() of pid {pid}" in fields["passed_over"], fields


def test_the_head_ray_start_runs_is_joined_and_said(ray_cluster, private_ray):
    joined, fields = connected()
    assert joined.endswith(f":{GCS_PORT}") and fields == {
        "address": joined, "found_by": "ray start", "passed_over": fields["passed_over"]}, fields
    assert private_ray[0] in fields["passed_over"]
