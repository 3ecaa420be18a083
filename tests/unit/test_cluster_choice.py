"""How ``raymesh run`` tells a ``ray start`` head from another program's private ``ray.init()`` (a raylet's
command line and parent), without starting Ray: ``tests/integration/test_cluster_choice.py`` does it for real."""

from __future__ import annotations

import os
from collections import namedtuple

from orchestrator.runtime.cluster import _cluster_of, _is_ray_start

Uids = namedtuple("Uids", "real effective saved")
WORKER_FLAGS = "--node-ip-address=10.0.0.5 --gcs-address=10.0.0.5:41229 --session-name=session_2026_{pid} --webui="


def raylet(ppid: int, starter: int) -> dict:
    """psutil's fields of a raylet whose session ``starter`` began and whose parent is ``ppid``."""
    return {"pid": 4242, "ppid": ppid, "uids": Uids(1000, 1000, 1000),
            "cmdline": ["/venv/lib/ray/core/src/ray/raylet/raylet", "--node_ip_address=10.0.0.5",
                        f"--python_worker_command=/venv/bin/python worker.py {WORKER_FLAGS.format(pid=starter)}"]}


def test_a_raylet_whose_parent_started_its_session_is_that_program_s_private_ray():
    found = _cluster_of(raylet(ppid=os.getpid(), starter=os.getpid()))  # this process: alive, not `ray start`
    assert (found.address, found.started_by, found.starter, found.uid) == ("10.0.0.5:41229", "driver", os.getpid(),
                                                                           1000)
    assert "pytest" in found.starter_cmd or "python" in found.starter_cmd


def test_a_raylet_its_starter_left_is_a_ray_start_head():
    """``ray start`` exits once its head runs: the raylet belongs to init (or a subreaper) from then on."""
    assert _cluster_of(raylet(ppid=1, starter=os.getpid())).started_by == "ray start"


def test_ray_start_block_is_told_from_a_driver():
    assert _is_ray_start(["/venv/bin/python", "/venv/bin/ray", "start", "--head", "--block"])
    assert _is_ray_start(["python", "-m", "ray.scripts.scripts", "start", "--address=10.0.0.5:6379"])
    assert not _is_ray_start(["python", "-c", "import ray; ray.init()"])
    assert not _is_ray_start(["python", "train.py", "start"])


def test_other_processes_are_no_cluster():
    assert _cluster_of({"pid": 1, "ppid": 0, "uids": Uids(0, 0, 0), "cmdline": ["/sbin/init"]}) is None
    assert _cluster_of({"pid": 1, "ppid": 0, "uids": Uids(0, 0, 0), "cmdline": None}) is None
