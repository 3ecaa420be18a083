"""On a GPU the ranks ask NCCL to abort a failed communicator and raise, not to end the process: survivors of a
lost rank must live to re-form the group (``process_group.keep_survivors_on_nccl_errors``). The GPU behaviour
itself is what ``benchmarks/gpu.py --check-abort`` measures; here, that the setting is made and a user's kept."""

from __future__ import annotations

import pytest
import torch

from workers.contract.grid import Grid
from workers.parallel import process_group as pg


def test_survivors_are_kept_unless_the_user_chose_otherwise(monkeypatch):
    _unset(monkeypatch)
    pg.keep_survivors_on_nccl_errors()
    assert pg.os.environ[pg.NCCL_ERROR_HANDLING] == "2"
    monkeypatch.setenv(pg.NCCL_ERROR_HANDLING, "1")
    pg.keep_survivors_on_nccl_errors()
    assert pg.os.environ[pg.NCCL_ERROR_HANDLING] == "1"


@pytest.mark.parametrize("device, expected", [("cuda", "2"), ("cpu", None)])
def test_init_mesh_sets_nccl_error_handling_only_for_nccl(device, expected, monkeypatch):
    """``init_mesh`` up to the point a group would start: the store and the group are replaced by recorders."""
    _unset(monkeypatch)
    seen = {}

    def init_process_group(backend, **_):
        seen["backend"], seen["env"] = backend, pg.os.environ.get(pg.NCCL_ERROR_HANDLING)

    monkeypatch.setattr(pg.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(pg.dist, "init_process_group", init_process_group)
    monkeypatch.setattr(pg, "join_store", lambda *a, **k: None)
    monkeypatch.setattr(pg, "_mesh", lambda *a, **k: None)
    pg.init_mesh(0, 1, "127.0.0.1", 0, Grid(dp=1, pp=1, tp=1), torch.device(device))
    assert seen == {"backend": "nccl" if device == "cuda" else "gloo", "env": expected}


def _unset(monkeypatch) -> None:
    """Remove the variables ``init_mesh`` sets (on loopback the link interfaces too) so that monkeypatch restores the
    process's own state afterwards (a plain delenv of an absent variable records nothing, and what the test then
    sets would outlive it: in every later test, and in the Ray cluster the integration tests start)."""
    for name in (pg.NCCL_ERROR_HANDLING, *pg.LINK_INTERFACE_VARS):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
