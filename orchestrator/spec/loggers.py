"""The `loggers:` section: the experiment trackers the controller reports each step to.

Written as a mapping (`tensorboard: {}`, `mlflow: {tracking_uri: ...}`) or as a list of names (each a string, or a
one-key mapping with its settings); both validate to one `LoggersSpec` whose unset trackers are None.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

from pydantic import model_serializer, model_validator

from orchestrator.errors import SpecError
from orchestrator.spec.fields import NonEmptyStr, PathStr, _Section

# logger -> (the modules it imports, the pip packages that provide them); a missing one is refused before any actor
# starts. MLflow's local store is an SQLite database, which it opens through sqlalchemy and alembic.
LOGGER_PACKAGES = {
    "tensorboard": (("tensorboard",), "tensorboard"),
    "mlflow": (("mlflow", "sqlalchemy", "alembic"), "mlflow-skinny sqlalchemy alembic"),
    "wandb": (("wandb",), "wandb"),
}
INSTALL_HINT = "pip install -e '.[trackers]' in the raymesh checkout"


class TensorBoardSpec(_Section):
    """TensorBoard event files (torch's `SummaryWriter`)."""

    dir: PathStr | None = None  # default RUN_DIR/tensorboard


class MLflowSpec(_Section):
    """An MLflow run: in a local SQLite file or on a tracking server."""

    # a URI (http://host:5000, sqlite:///path.db, file:/dir) or an SQLite file path (relative: under the run dir);
    # default RUN_DIR/mlflow.db
    tracking_uri: NonEmptyStr | None = None
    experiment: NonEmptyStr | None = None  # default: the job's name
    run_name: NonEmptyStr | None = None  # default: the run dir's name


class WandbSpec(_Section):
    """A Weights & Biases run; offline by default, so it needs no network or account (`wandb sync` uploads it)."""

    project: NonEmptyStr = "raymesh"
    mode: Literal["offline", "online"] = "offline"
    dir: PathStr | None = None  # where its `wandb/` folder goes; default the run dir
    entity: NonEmptyStr | None = None
    run_name: NonEmptyStr | None = None  # default: the run dir's name


def _refuse_twice(mapping: dict[str, Any], item: dict[str, Any]) -> None:
    """A logger listed twice would silently keep its last settings, as a YAML key written twice would."""
    name = next(iter(item))
    if name in mapping:
        raise SpecError(f"loggers.{name}", item[name], "is listed twice in loggers; only the last entry's settings "
                        "would be used", f"keep one `{name}` entry in loggers, with all its settings")


class LoggersSpec(_Section):
    tensorboard: TensorBoardSpec | None = None
    mlflow: MLflowSpec | None = None
    wandb: WandbSpec | None = None

    @model_validator(mode="before")
    @classmethod
    def _list_of_names(cls, data: Any) -> Any:
        """`[tensorboard, {mlflow: {...}}]` is the mapping `{tensorboard: {}, mlflow: {...}}`; a mapping's
        `tensorboard:` with nothing under it (YAML null) turns the logger on with its defaults."""
        if isinstance(data, list):
            mapping: dict[str, Any] = {}
            for item in data:
                if isinstance(item, str):
                    item = {item: {}}
                elif not (isinstance(item, dict) and len(item) == 1):
                    raise SpecError("loggers", item, "is not a logger name or a one-key mapping of its settings",
                                    "write e.g. `loggers: [tensorboard, {mlflow: {tracking_uri: runs/mlruns}}]`")
                _refuse_twice(mapping, item)
                mapping.update(item)
            data = mapping
        if isinstance(data, dict):
            return {k: ({} if v is None else v) for k, v in data.items()}
        return data

    @model_serializer(mode="wrap")
    def _only_enabled(self, handler) -> dict[str, Any]:
        """Dump only the loggers that are on: a dumped `tensorboard: null` would read back as on (see above)."""
        return {k: v for k, v in handler(self).items() if v is not None}

    def enabled(self) -> list[str]:
        return [name for name in LOGGER_PACKAGES if getattr(self, name) is not None]

    def check_installed(self) -> None:
        """Refuse a logger whose package is not installed, naming it and the pip command (before any actor)."""
        for name in self.enabled():
            modules, packages = LOGGER_PACKAGES[name]
            missing = [m for m in modules if importlib.util.find_spec(m) is None]
            if missing:
                raise SpecError(f"loggers.{name}", getattr(self, name).model_dump(),
                                f"needs the `{'`, `'.join(missing)}` package(s), which are not installed",
                                f"{INSTALL_HINT} (or pip install {packages}), or remove loggers.{name}")

    def resolved_dir(self, name: str, run_dir: Path) -> Path:
        """A logger's output directory: its `dir` when set, else its default under the run dir."""
        configured = getattr(getattr(self, name), "dir", None)
        return Path(configured) if configured else run_dir / {"tensorboard": "tensorboard", "wandb": "."}[name]
