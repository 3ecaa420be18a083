"""Reading a job file: YAML, `key.path=value` overrides, relative paths -> a validated `JobSpec`.

A job file is YAML with optional sections (`model`, `data`, `parallel`, `optim`,
`precision`, `memory`, `train`, `checkpoint`) plus top-level `name` and
`run_dir`; only `data.path` is required. Everything that can be checked without
touching the cluster or the data is checked here, so a bad job fails before
any Ray actor starts, with a `SpecError` that names the field, the value and a
fix.

Path rule: `load_spec` resolves relative `data.path`, `run_dir` and
`checkpoint.dir` (from the file or from overrides) against the CURRENT WORKING
DIRECTORY, not the job file's directory. That is what `ray job submit
--working-dir .` needs: the driver runs inside the uploaded copy of the
directory the user submitted from. `JobSpec.from_dict` and `with_overrides`
keep paths verbatim, because they are used to pass an already resolved spec
between processes."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import SpecError
from orchestrator.spec.job import JobSpec


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """Split `key.path=value` into (path parts, value).

    The value is read as YAML so `4`, `0.1`, `true` and `[1, 2]` keep their types;
    an empty value is null, which resets an optional field to its default.
    """
    key, sep, raw = text.partition("=")
    if not sep:
        raise SpecError(
            None,
            text,
            "has no `=`",
            "write overrides as `key.path=value`, e.g. `parallel.dp=4` or `optim.betas=[0.9,0.99]`",
            where="override",
        )
    parts = tuple(p.strip() for p in key.split("."))
    if not all(parts):
        raise SpecError(
            None,
            text,
            "has an empty key segment before `=`",
            "name the field as dotted keys, e.g. `train.steps=10`",
            where="override",
        )
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        raise SpecError(
            ".".join(parts), raw, "is not a valid YAML value", "quote the value, e.g. `name='my job'`", where="override"
        ) from None
    return parts, value


def apply_overrides(raw: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a deep copy of a raw job dict with overrides applied, creating sections as needed."""
    out = copy.deepcopy(dict(raw))
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                raise SpecError(
                    prefix,
                    child,
                    f"is not a section, so override `{text}` cannot set a field inside it",
                    f"override `{prefix}` itself, e.g. `{prefix}=<value>`",
                )
            node = child
        node[parts[-1]] = value
    return out


def _resolve_paths(raw: dict[str, Any], cwd: Path) -> None:
    """Make relative path fields absolute against `cwd`, in place (see module docstring)."""
    for section, key in ((None, "run_dir"), ("data", "path"), ("checkpoint", "dir"), ("metrics", "file_sd"),
                         ("memory.offload", "path"), ("model.lora", "base_checkpoint"), ("control", "tls_cert"),
                         ("control", "tls_key"), ("model", "init_from")):
        holder = raw
        for name in section.split(".") if section else ():
            holder = holder.get(name) if isinstance(holder, dict) else None
        if isinstance(holder, dict) and isinstance(holder.get(key), str) and holder[key]:
            holder[key] = str(cwd / Path(holder[key]).expanduser())


def load_spec(path: str | Path, overrides: Iterable[str] = ()) -> JobSpec:
    """Read a YAML job file, apply `key.path=value` overrides and validate.

    Relative `data.path`, `run_dir` and `checkpoint.dir` become absolute against
    the current working directory.
    """
    p = Path(path)
    try:
        text = p.read_text()
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
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(exc, "problem", None) or str(exc)
        line_fix = f" near line {mark.line + 1}" if mark else ""
        raise SpecError(
            None,
            str(path),
            f"is not valid YAML{where}: {reason}",
            f"correct the YAML{line_fix}: check indentation, and that each `key: value` has a space after the colon",
        ) from None
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
