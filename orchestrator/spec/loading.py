"""Reading a job file: YAML, `key.path=value` overrides, relative paths -> a validated `JobSpec`.

A job file is YAML with optional sections (`model`, `data`, `parallel`, `optim`,
`precision`, `memory`, `train`, `checkpoint`) plus top-level `name` and
`run_dir`; only `data.path` (or `data.mix`, a weighted list of them) is required. Everything that can be checked without
touching the cluster or the data is checked here, so a bad job fails before
any Ray actor starts, with a `SpecError` that names the field, the value and a
fix.

Path rule: `load_spec` resolves relative `data.path`, each `data.mix` path, `eval.path`, `run_dir`,
`checkpoint.dir` and the other path fields (from the file or from overrides) against the CURRENT WORKING
DIRECTORY, not the job file's directory. That is what `ray job submit
--working-dir .` needs: the driver runs inside the uploaded copy of the
directory the user submitted from. `JobSpec.from_dict` and `with_overrides`
keep paths verbatim, because they are used to pass an already resolved spec
between processes."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from orchestrator.errors import SpecError
from orchestrator.spec.job import JobSpec
from orchestrator.spec.raw import apply_overrides, decode_text, parse_yaml


def _resolve_paths(raw: dict[str, Any], cwd: Path) -> None:
    """Make relative path fields absolute against `cwd`, in place (see module docstring)."""
    for section, key in ((None, "run_dir"), ("data", "path"), ("eval", "path"), ("checkpoint", "dir"),
                         ("metrics", "file_sd"), ("memory.offload", "path"), ("model.lora", "base_checkpoint"),
                         ("control", "tls_cert"), ("control", "tls_key"), ("parameter_server", "tls_cert"),
                         ("parameter_server", "tls_key"), ("model", "init_from"), ("loggers.tensorboard", "dir"),
                         ("loggers.wandb", "dir")):
        holder = raw
        for name in section.split(".") if section else ():
            holder = holder.get(name) if isinstance(holder, dict) else None
        _resolve_entry(holder, key, cwd)
    mix = raw.get("data", {}).get("mix") if isinstance(raw.get("data"), dict) else None
    for entry in mix if isinstance(mix, list) else ():
        _resolve_entry(entry, "path", cwd)


def _resolve_entry(holder: Any, key: str, cwd: Path) -> None:
    """`holder[key]` absolute against `cwd` when it is a relative path (URLs stay as written: checkpoint.dir)."""
    if isinstance(holder, dict) and isinstance(holder.get(key), str) and holder[key] and "://" not in holder[key]:
        holder[key] = str(cwd / Path(holder[key]).expanduser())


def load_spec(path: str | Path, overrides: Iterable[str] = ()) -> JobSpec:
    """Read a YAML job file, apply `key.path=value` overrides and validate.

    Relative `data.path` (and `data.mix` paths), `run_dir` and `checkpoint.dir` become absolute against
    the current working directory.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise SpecError(
            None,
            str(path),
            f"does not exist (looked for {p.absolute()})",
            f"check the path; relative paths are taken from the current directory {os.getcwd()}",
        ) from None
    except OSError as exc:
        problem = f"cannot be read ({exc.strerror})"
        raise SpecError(None, str(path), problem, "pass the path of a readable YAML file") from None
    raw = parse_yaml(decode_text(data, str(path)), str(path))
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(
            None,
            str(path),
            f"holds a YAML {type(raw).__name__}, not a mapping of sections",
            "write the job as `section:` blocks, e.g. `data:` then `  path: data/tiny` on the next line",
        )
    raw = apply_overrides(raw, overrides)
    _resolve_paths(raw, Path.cwd())
    return JobSpec.from_dict(raw)
