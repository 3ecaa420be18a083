"""The driver side of raymesh: job spec, planner, placement, controller, CLI.

The names below load on first use (PEP 562): ``raymesh plan`` and the spec checks are arithmetic and should not
pay for importing Ray and torch, which the controller and client need.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Client": "orchestrator.client",
    "JobSpec": "orchestrator.spec",
    "RunResult": "orchestrator.run_result",
    "SpecError": "orchestrator.errors",
    "TrainingJob": "orchestrator.runtime.controller",
    "load_spec": "orchestrator.spec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
