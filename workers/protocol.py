"""The records a rank hands the controller: frozen dataclasses, one producer each, ``to_dict()`` for JSON.

Ray pickles these across the actor boundary; the controller reads attributes, never string keys, and the
run records and summary JSON are written from ``to_dict()``, so their keys are exactly the ones users and
``raymesh report`` already read. Torch-free, so the controller imports it without torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

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


@dataclass(frozen=True)
class StepResult:
    """What one rank reports after one optimizer step (or one asynchronous PS round).

    ``loss`` is None on ranks that hold no last pipeline stage. ``memory`` is present only when the job
    measures memory, ``timeline`` only when it records pipeline events, ``local_steps``/``clock`` only under
    asynchronous parameter-server rounds; ``to_dict`` leaves absent ones out, as the JSON always did.
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
    memory: dict[str, int] | None = None
    timeline: list[dict[str, Any]] | None = None
    local_steps: int | None = None
    clock: int | None = None
    moe: dict[str, dict[str, Any]] | None = None  # per MoE layer: load, drops, aux losses (workers.model.moe)
    replicated_step: int = -1  # newest step whose snapshot replica is known to be held by this rank's holder
    # bytes this rank's collectives sent this step per mesh dimension (workers.diagnostics.comm_bytes)
    comm_bytes: dict[str, int] | None = None
    # under dp_sync ps: this rank's push and pull payload bytes and its largest asp/ssp read staleness this step
    ps: dict[str, int] | None = None
    # after an evaluated step (eval.every): the held-out loss of this rank's share (None off the last pipeline
    # stage) and the seconds the evaluation took on this rank (workers.evaluation)
    eval_loss: float | None = None
    eval_s: float | None = None
    # under data.mix: the samples each source (by path) has supplied up to this step (workers.data.blend)
    data_mix: dict[str, int] | None = None
    # under train.objective: dpo: the global batch's reward accuracy and mean chosen/rejected rewards and margin
    # (workers.model.dpo.FIGURES), the same on every rank
    dpo: dict[str, float] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepResult:
        """The inverse of ``to_dict`` (tests and records read back as typed results)."""
        return cls(**{**data, "time_s": StepTimes(**data["time_s"])})

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in _OPTIONAL:
                continue
            out[f.name] = value.to_dict() if isinstance(value, StepTimes) else value
        return out


_OPTIONAL = frozenset({"memory", "timeline", "local_steps", "clock", "comm_bytes", "moe", "ps", "eval_loss", "eval_s",
                       "data_mix", "dpo"})


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
