"""The job file's JSON Schema and its reference page, both generated from the pydantic sections.

One source of truth: types, defaults and bounds are the schema pydantic derives from ``JobSpec`` (what the loader
enforces), each field's meaning is its ``Field(description=...)`` or, failing that, its entry in
``orchestrator.spec.field_docs``. ``raymesh schema`` prints :func:`job_schema` (editors read the committed copy,
docs/job.schema.json, through the comment at the top of every example), and the documentation site's build hook
(docs/hooks.py) renders :func:`job_file_markdown` into docs/reference/job-file.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from orchestrator.spec.field_docs import FIELD_DOCS
from orchestrator.spec.fields import _SECTIONS
from orchestrator.spec.job import JobSpec

SCHEMA_FILE = "docs/job.schema.json"  # the committed copy of `raymesh schema`, named by every example's first line
_BOUNDS = (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<"),
           ("minItems", "at least {} items"), ("maxItems", "at most {} items"),
           ("minLength", "length ≥ {}"), ("maxLength", "length ≤ {}"))


@dataclass(frozen=True)
class FieldEntry:
    """One job-file field as the reference shows it."""

    path: str  # dotted, as `--set` takes it (list items' fields under the list's name: `faults.kind`)
    type: str
    default: str
    bounds: str
    meaning: str


def job_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a job file: pydantic's, with every field's meaning as its description."""
    schema = JobSpec.model_json_schema(by_alias=True)
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema, "title": "raymesh job file"}
    for path, node in _fields(schema, schema, ""):
        meaning = FIELD_DOCS.get(path)
        if meaning and "description" not in node:
            node["description"] = meaning
    _loggers_as_list(schema)
    _empty_sections(schema)
    return schema


def _empty_sections(schema: dict[str, Any]) -> None:
    """A section written with nothing under it (every line commented out: YAML null) means its defaults
    (``JobSpec._empty_sections_mean_defaults``): the schema takes null there too."""
    for name in _SECTIONS:
        node = schema["properties"][name]
        kept = {key: value for key, value in node.items() if key in ("description", "default")}
        options = node.get("anyOf", [{key: value for key, value in node.items() if key not in kept}])
        if {"type": "null"} not in options:
            schema["properties"][name] = {"anyOf": [*options, {"type": "null"}], **kept}


def _loggers_as_list(schema: dict[str, Any]) -> None:
    """``loggers:`` may also be a list of names or one-key mappings (``LoggersSpec._list_of_names`` turns it into
    the mapping before validation, which pydantic's schema cannot see): say so, or editors would flag a valid file."""
    mapping = dict(schema["properties"]["loggers"])
    description = mapping.pop("description", None)
    loggers = _resolve(schema, mapping)["properties"]
    item = {"anyOf": [{"enum": list(loggers)},
                      {"type": "object", "minProperties": 1, "maxProperties": 1, "properties": loggers,
                       "additionalProperties": False}]}
    schema["properties"]["loggers"] = {"anyOf": [mapping, {"type": "array", "items": item}],
                                       **({"description": description} if description else {})}


def schema_text() -> str:
    """:func:`job_schema` as `raymesh schema` prints it and docs/job.schema.json holds it."""
    return json.dumps(job_schema(), indent=2, ensure_ascii=False) + "\n"


def _resolve(root: dict, node: dict) -> dict:
    """``node`` itself, or the definition its ``$ref`` points at."""
    ref = node.get("$ref")
    return root["$defs"][ref.rsplit("/", 1)[-1]] if ref else node


def _objects(root: dict, node: dict):
    """The object schemas a field's value may be (through references, unions and list items)."""
    node = _resolve(root, node)
    if "properties" in node:
        yield node
    for option in node.get("anyOf", ()):
        yield from _objects(root, option)
    if isinstance(node.get("items"), dict):
        yield from _objects(root, node["items"])


def _fields(root: dict, node: dict, prefix: str):
    """(dotted path, property schema) of every field under ``node``, depth first in declaration order."""
    for obj in _objects(root, node):
        for name, prop in obj["properties"].items():
            path = prefix + name
            yield path, prop
            yield from _fields(root, prop, path + ".")


def _type(root: dict, node: dict) -> str:
    """A reader's name for a property schema's type: `integer`, one of `a`, `b`, list of ..., section."""
    if "$ref" in node:
        target = _resolve(root, node)
        return "section" if "properties" in target else _type(root, target)
    if "enum" in node:
        return "one of " + ", ".join(f"`{json.dumps(v)}`" if not isinstance(v, str) else f"`{v}`" for v in node["enum"])
    if "const" in node:
        return f"`{node['const']}`"
    if "anyOf" in node:
        return " or ".join(dict.fromkeys(_type(root, option) for option in node["anyOf"]))
    kind = node.get("type", "any")
    if kind == "array":
        if "prefixItems" in node:
            return "list of " + ", ".join(_type(root, item) for item in node["prefixItems"])
        return "list of " + (_type(root, node["items"]) if isinstance(node.get("items"), dict) else "values")
    if kind == "object" and "additionalProperties" in node and isinstance(node["additionalProperties"], dict):
        return "mapping to " + _type(root, node["additionalProperties"])
    return {"integer": "whole number", "number": "number", "string": "string", "boolean": "true/false",
            "null": "null", "object": "mapping"}.get(kind, kind)


def _bounds(root: dict, node: dict) -> str:
    """The numeric and size limits a property schema states (its union members' included)."""
    said = []
    items = [node["items"]] if isinstance(node.get("items"), dict) else []
    for part in (node, *node.get("anyOf", ()), *items):
        part = _resolve(root, part) if "$ref" in part and "properties" not in _resolve(root, part) else part
        for key, word in _BOUNDS:
            if key in part:
                said.append(word.format(part[key]) if "{}" in word else f"{word} {part[key]}")
    return ", ".join(dict.fromkeys(said))


def _default(node: dict, required: bool) -> str:
    if required:
        return "required"
    if "default" not in node:
        return "—"
    return f"`{json.dumps(node['default'], ensure_ascii=False)}`"


def field_entries() -> list[FieldEntry]:
    """Every job-file field, in declaration order: the rows of the job-file reference."""
    schema = job_schema()
    entries: dict[str, FieldEntry] = {}
    required = _required_paths(schema, schema, "")
    for path, prop in _fields(schema, schema, ""):
        if path in entries:  # a section reachable two ways (`loggers` as a mapping or a list): its first
            continue
        entries[path] = (FieldEntry(path, _type(schema, prop), _default(prop, path in required),
                                  _bounds(schema, prop), prop.get("description", "")))
    return list(entries.values())


def _required_paths(root: dict, node: dict, prefix: str) -> set[str]:
    out = set()
    for obj in _objects(root, node):
        out |= {prefix + name for name in obj.get("required", ())}
        for name, prop in obj["properties"].items():
            out |= _required_paths(root, prop, prefix + name + ".")
    return out


def _section_text(schema: dict, name: str) -> str:
    """A top-level section's own description: its class docstring's first paragraph."""
    objects = list(_objects(schema, schema["properties"][name]))
    text = objects[0].get("description", "") if objects else ""
    return text.split("\n\n")[0].replace("\n", " ")


def job_file_markdown() -> str:
    """The generated part of docs/reference/job-file.md: one heading per section, one entry per field."""
    schema = job_schema()
    lines = []
    for entry in field_entries():
        if "." not in entry.path:
            lines += [f"## `{entry.path}`", ""]
            section = _section_text(schema, entry.path) or entry.meaning
            lines += [section, ""] if section else []
            if entry.type.startswith(("section", "list of section")):
                continue
        else:
            lines += [f"### `{entry.path}`", ""]
        facts = [f"**type** {entry.type}", f"**default** {entry.default}"]
        facts += [f"**bounds** {entry.bounds}"] if entry.bounds else []
        lines += [" · ".join(facts), ""]
        lines += [entry.meaning, ""] if entry.meaning and "." in entry.path else []
    return "\n".join(lines)
