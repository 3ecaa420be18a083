"""The records a rank hands the controller: frozen dataclasses, one producer each, ``to_dict()`` for JSON.

Ray pickles these across the actor boundary; the controller reads attributes, never string keys, and the
run records and summary JSON are written from ``to_dict()``, so their keys are exactly the ones users and
``raymesh report`` already read. Torch-free, so the controller imports it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from workers.contract.figures import FIGURES, check_keys

PHASES = ("data", "compute", "bubble", "communication", "optimizer", "step")


@dataclass(frozen=True)
class StepTimes:
    """Seconds of one step per phase (see ``Trainer.train_step`` for what each phase covers)."""

    data: float = 0.0
    compute: float = 0.0
    bubble: float = 0.0
    communication: float = 0.0
    optimizer: float = 0.0
    step: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True, init=False)
class StepResult:
    """What one rank reports after one optimizer step (or one asynchronous PS round).

    ``loss`` is None on ranks that hold no last pipeline stage. Every per-feature figure (measured memory, the
    timeline, MoE statistics, comm bytes, the held-out loss ...) is an entry of ``extras`` under its figure's key,
    present only when the feature ran; each key has one reducer in ``workers.contract.figures``, which is how the
    controller records it. Built and read flat, as the JSON always was: ``StepResult(..., moe={...})`` puts
    ``moe`` in ``extras``, ``to_dict`` writes it at the top level and ``result.moe`` reads it (None when absent).
    """

    rank: int
    step: int
    loss: float | None
    grad_norm: float
    lr: float
    tokens: int
    applied: bool
    time_s: StepTimes
    peak_memory_bytes: int
    current_memory_bytes: int
    replicated_step: int = -1  # newest step whose snapshot replica is known to be held by this rank's holder
    extras: Mapping[str, Any] = field(default_factory=dict)

    def __init__(self, *, extras: Mapping[str, Any] | None = None, **named: Any):
        """Core fields by name; any other name is a figure of ``extras`` (None: absent), refused unless a figure
        is registered for it (``workers.contract.figures.check_keys``)."""
        core = {f.name: f for f in fields(self) if f.name != "extras"}
        missing = [name for name, f in core.items() if name not in named and f.default is MISSING]
        if missing:
            raise TypeError(f"StepResult is missing core field(s) {missing}")
        given = {**(extras or {}), **{k: v for k, v in named.items() if k not in core}}
        figures = {k: v for k, v in given.items() if v is not None}
        check_keys(figures)
        for name, f in core.items():
            object.__setattr__(self, name, named.get(name, f.default))
        object.__setattr__(self, "extras", figures)

    def __getattr__(self, name: str) -> Any:
        """A registered figure's value by name (None when this step has none), as the fields it replaced read."""
        if name.startswith("_") or name not in FIGURES:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.__dict__.get("extras", {}).get(name)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepResult:
        """The inverse of ``to_dict`` (tests and records read back as typed results)."""
        return cls(**{**data, "time_s": StepTimes(**data["time_s"])})

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: the core fields, then each figure of ``extras`` at the top level under its key."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extras"}
        return {**out, "time_s": self.time_s.to_dict(), **self.extras}


@dataclass(frozen=True)
class RankInfo:
    """Where a rank lives once formed: grid coordinates, stages, device and process identity."""

    rank: int
    coords: dict[str, int]
    stages: list[int]
    device: str
    device_name: str
    pid: int
    node_id: str
    actor_id: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def identity(self) -> dict[str, Any]:
        """The process identity a recovery record keeps (to show which processes were replaced)."""
        return {"pid": self.pid, "actor_id": self.actor_id, "node_id": self.node_id}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankInfo:
        names = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in data.items() if k in names},
                   extra={k: v for k, v in data.items() if k not in names})

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**out, **self.extra}
