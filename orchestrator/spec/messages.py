"""Pydantic's validation errors -> one `SpecError` that names the field, the value and the fix."""

from __future__ import annotations

import difflib
import itertools
import json
import math
import types
import typing
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from orchestrator.errors import NO_VALUE, SpecError
from orchestrator.spec.fields import _SECTIONS

_EXPECTED = {
    "int_type": "a whole number",
    "int_parsing": "a whole number",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "finite_number": "a finite number (not .inf or .nan)",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string (quote it if YAML reads it as a number or boolean)",
    "string_too_short": "a non-empty string",
    "string_pattern_mismatch": "a name of letters, digits, '.', '_' or '-' (it becomes a directory name)",
    "model_type": "a section: indented `key: value` lines under it",
    "tuple_type": "a list",
    "list_type": "a list: one `- ` line per item under it (or `[a, b]`)",
}
# a list of the wrong length: the bound pydantic reports, as the fix states it
_LENGTHS = {"too_short": ("min_length", "at least"), "too_long": ("max_length", "at most")}

_BOUNDS = {
    "greater_than": (">", "gt"),
    "greater_than_equal": (">=", "ge"),
    "less_than": ("<", "lt"),
    "less_than_equal": ("<=", "le"),
}


def _keys_of(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """Accepted keys of a section: YAML aliases first, then python names."""
    keys = {info.alias or name: info for name, info in model.model_fields.items()}
    keys.update({name: info for name, info in model.model_fields.items() if name not in keys})
    return keys


def _yaml_keys(model: type[BaseModel]) -> list[str]:
    return [info.alias or name for name, info in model.model_fields.items()]


def _section_model(info: FieldInfo) -> type[BaseModel] | None:
    """The model of a section field, or of the items of a list-of-sections field (`faults`)."""
    ann = info.annotation
    if typing.get_origin(ann) in (typing.Union, types.UnionType):  # an optional section such as model.lora
        ann = next(a for a in typing.get_args(ann) if a is not type(None))
    if typing.get_origin(ann) is list:
        ann = typing.get_args(ann)[0]
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The section model reached by following `loc` from `root` (the `JobSpec`; None past a leaf; list indices pass
    through)."""
    model: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int):
            continue
        info = _keys_of(model).get(part) if model is not None else None
        model = _section_model(info) if info is not None else None
    return model


def _field_at(root: type[BaseModel], loc: tuple[Any, ...]) -> FieldInfo | None:
    """FieldInfo of the field at `loc`; trailing tuple indices (optim.betas[0]) map to the tuple field."""
    keys = tuple(itertools.takewhile(lambda part: isinstance(part, str), loc))
    model = _model_at(root, keys[:-1]) if keys else None
    return _keys_of(model).get(keys[-1]) if model is not None else None


def _without_union_tags(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """`loc` without pydantic's union-member tags (`parallel.pp_split.literal['even','auto']`): past a leaf
    field only list indices name a place in the job file."""
    out: list[Any] = []
    model: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int) or model is not None:
            out.append(part)
        if not isinstance(part, int) and model is not None:
            info = _keys_of(model).get(part)
            model = _section_model(info) if info is not None else None
    return tuple(out)


def _choices(annotation: Any) -> tuple[list[Any], bool] | None:
    """A `Literal[...]` field's choices, or those of `Literal[...] | list[...]` and True for the list member."""
    if get_origin(annotation) is Literal:
        return list(get_args(annotation)), False
    members = get_args(annotation) if get_origin(annotation) in (typing.Union, types.UnionType) else ()
    literals = [m for m in members if get_origin(m) is Literal]
    if len(literals) != 1:
        return None
    return list(get_args(literals[0])), any(get_origin(m) is list for m in members)


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _unknown_field(root: type[BaseModel], loc: tuple[Any, ...]) -> SpecError:
    parent_loc, key = loc[:-1], str(loc[-1])
    parent = _model_at(root, parent_loc)
    valid = _yaml_keys(parent) if parent is not None else []
    close = difflib.get_close_matches(key, valid, n=1)
    if close:
        hint = f"did you mean `{close[0]}`? "
    else:
        homes = [s for s in _SECTIONS if key in _keys_of(_model_at(root, (s,)))]
        hint = f"did you mean `{homes[0]}.{key}` (put it under `{homes[0]}:`)? " if homes else "remove or rename it; "
    if parent_loc:
        return SpecError(".".join(map(str, loc)), NO_VALUE, "unknown field", f"{hint}valid fields: {', '.join(valid)}")
    return SpecError(key, NO_VALUE, "unknown top-level section", f"{hint}valid top-level keys: {', '.join(valid)}")


def to_spec_error(exc: ValidationError, root: type[BaseModel]) -> SpecError:
    """Turn the most useful pydantic error into a SpecError; count the rest. ``root`` is the model that raised it
    (``JobSpec``, which hands itself in: it imports this module), where every error's location starts."""
    errors = sorted(exc.errors(), key=lambda e: e["type"] not in ("extra_forbidden", "invalid_key"))
    first, more = errors[0], len(errors) - 1
    ctx = first.get("ctx") or {}
    if isinstance(ctx.get("error"), SpecError):
        return ctx["error"].with_more(more)
    loc, kind = _without_union_tags(root, tuple(first["loc"])), first["type"]
    field = _dotted(loc)
    if kind in ("extra_forbidden", "invalid_key"):
        return _unknown_field(root, loc).with_more(more)
    info = _field_at(root, loc)
    if kind == "missing" and isinstance(loc[-1], int):  # short list for a fixed-size tuple such as optim.betas
        field = _dotted(loc[:-1])
        info = _field_at(root, loc[:-1])
        size = len(get_args(info.annotation)) if info is not None else 0
        items = f" of {size} items" if size else ""
        fix = f"set `{field}` to a list{items}{_default_hint(info)}"
        return SpecError(field, list(first.get("input") or ()), f"has too few items{items and f' (needs {size})'}",
                         fix, more=more)
    if kind == "missing":
        if field == "data":
            fix = (
                "add a `data:` section with `path: <dir>`, "
                "the directory written by `raymesh prepare-data --out <dir>`"
            )
        else:
            fix = f"add `{field}` to the job file"
        return SpecError(field, NO_VALUE, "is required but missing", fix, more=more)
    if kind == "literal_error" and info is not None and _choices(info.annotation) is not None:
        choices, or_list = _choices(info.annotation)
        expected = f"one of {', '.join(map(str, choices))}" + (", or a list" if or_list else "")
        close = difflib.get_close_matches(str(first["input"]), [str(c) for c in choices], n=1)
        if close:
            expected += f" (did you mean {close[0]}?)"
    elif kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        expected = f"a number {op} {ctx[key]}"
    elif kind in _LENGTHS and ctx.get(_LENGTHS[kind][0]) is not None:
        key, words = _LENGTHS[kind]
        expected = f"a list of {words} {ctx[key]} item{'s' if ctx[key] != 1 else ''}"
    elif kind == "value_error":  # a field's own validator (fields._os_path, _host): its message is the problem
        problem, _, fix = first["msg"].removeprefix("Value error, ").partition("; fix: ")  # and its own fix, if any
        fix = fix or f"set `{field}` to a shorter path of plain characters"
        return SpecError(field, first.get("input"), problem, fix, more=more)
    else:
        expected = _EXPECTED.get(kind) or first["msg"].removeprefix("Input should be ")
        if kind in ("int_type", "float_type") and _looks_numeric(first.get("input")):
            expected += ", written without quotes (a quoted number is a string)"
        elif kind in ("int_type", "float_type") and isinstance(first.get("input"), str) and _non_finite(first["input"]):
            expected += " (not nan or inf)"
        if kind in ("int_type", "float_type") and isinstance(first.get("input"), bool):
            expected += " (true/false are not numbers)"
    msg = first["msg"]
    problem = "is not a section" if kind == "model_type" else f"is not valid ({msg[0].lower()}{msg[1:]})"
    return SpecError(field, first.get("input"), problem, f"set `{field}` to {expected}{_default_hint(info)}", more=more)


def _looks_numeric(value: Any) -> bool:
    """A string holding a finite number: the user quoted it (`"4"`); `nan`/`inf` are not numbers a field takes."""
    try:
        return isinstance(value, str) and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _non_finite(text: str) -> bool:
    """`nan`, `inf`, `-Infinity` as written in a `--set` or a quoted YAML value."""
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False


def _default_hint(info: FieldInfo | None) -> str:
    if info is None or info.default is PydanticUndefined or info.default is None:
        return ""
    return f"; the default is {json.dumps(info.default)}"
