"""The job file before validation, as a plain dict: strict YAML text in (duplicate keys, YAML 1.1's number
forms and non-UTF-8 bytes refused), and `key.path=value` overrides applied to one. Below `JobSpec`, which parses
overrides with it (`with_overrides`); reading a job file into a `JobSpec` is `loading.py`'s."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import yaml

from orchestrator.errors import NO_VALUE, SpecError


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, plus YAML 1.2's exponent floats (`1e-3` is a number, not the string "1e-3").

    PyYAML follows YAML 1.1, which wants a dot in a float; with strict number fields a user's `lr: 1e-3` would
    otherwise be refused as a string. Duplicate keys, and numbers YAML 1.1 reads as octal or base 60, are caught
    on the composed node tree (`_check_nodes`), where the whole key path is known.
    """


EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")  # 1e-3, 2E5, 1.5e3


def add_exponent_floats(cls: type) -> None:
    """Teach a PyYAML loader (or dumper, so it quotes such strings) that `1e-3` is a float, on its own copy."""
    cls.yaml_implicit_resolvers = {k: list(v) for k, v in cls.yaml_implicit_resolvers.items()}
    cls.add_implicit_resolver("tag:yaml.org,2002:float", EXPONENT_FLOAT, list("-+0123456789"))


add_exponent_floats(StrictLoader)


def _nodes(node: yaml.Node, path: tuple[str, ...], seen: set[int]) -> Iterator[tuple[yaml.Node, tuple[str, ...]]]:
    """Every node of a composed document with its key path (list items by index); an alias is walked once."""
    if id(node) in seen:
        return
    seen.add(id(node))
    yield node, path
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield from _nodes(value, (*path, str(key.value if isinstance(key, yaml.ScalarNode) else None)), seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _nodes(item, (*path, str(i)), seen)


def _check_duplicates(node: yaml.MappingNode, path: tuple[str, ...], source: str) -> None:
    """Refuse a key written twice in one mapping (PyYAML keeps the last silently), naming the key and both lines."""
    first: dict[Any, int] = {}
    for key, _ in node.value:
        name = key.value if isinstance(key, yaml.ScalarNode) else None
        if name is None or name == "<<":
            continue
        line = key.start_mark.line + 1
        if name in first:
            field = ".".join((*path, str(name)))
            raise SpecError(field, NO_VALUE, f"is written twice in {source} (lines {first[name]} and {line}); "
                            "YAML would silently keep the last", f"keep one `{name}:` and delete the other")
        first[name] = line


# plain scalars PyYAML (YAML 1.1) reads as numbers that YAML 1.2 and every reader of the file do not: a leading
# zero makes octal (`010` is 8) and colons make base 60 (`1:30` is 90)
YAML11_OCTAL = re.compile(r"^[-+]?0[0-7_]+$")
YAML11_BASE60 = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")


def _check_yaml11_number(node: yaml.ScalarNode, path: tuple[str, ...], source: str) -> None:
    """Refuse a plain number YAML 1.1 reads another way than it looks (`checkpoint.every: 0050` would be 40)."""
    if node.style is not None or node.tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float"):
        return
    kind = "octal" if YAML11_OCTAL.match(node.value) else "base 60" if YAML11_BASE60.match(node.value) else None
    if kind is None or node.value.strip("-+0_") == "":
        return
    read = yaml.load(node.value, Loader=StrictLoader)
    if kind == "octal":
        fix = f"write {int(node.value.replace('_', ''), 10)} without the leading zero for that decimal number"
    else:
        fix = f"write {read} if that is the number you mean"
    field = ".".join(path) or None
    line = node.start_mark.line + 1
    raise SpecError(field, node.value, f"(line {line} of {source}) is read by YAML 1.1 as the {kind} number {read}",
                    f"{fix}, or quote it if it is text")


def _check_nodes(node: yaml.Node, path: tuple[str, ...], source: str) -> None:
    """What PyYAML would silently get wrong: duplicate keys, and numbers read as octal or base 60."""
    for each, at in _nodes(node, path, set()):
        if isinstance(each, yaml.MappingNode):
            _check_duplicates(each, at, source)
        elif isinstance(each, yaml.ScalarNode):
            _check_yaml11_number(each, at, source)


MAX_VALUES = 100_000  # a job file holds a few hundred values; aliases can make a small file expand past any memory


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """How many values the document holds once aliases are expanded, counted in time linear in the file."""
    if id(node) not in memo:
        memo[id(node)] = 0  # a recursive alias counts once
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else (
            node.value if isinstance(node, yaml.SequenceNode) else [])
        memo[id(node)] = 1 + sum(_expanded_size(child, memo) for child in children)
    return memo[id(node)]


def decode_text(data: bytes, source: str) -> str:
    """The file's text; bytes that are not UTF-8 are refused with their offset and line, not a traceback."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        byte = data[exc.start:exc.start + 1]
        raise SpecError(None, source, f"is not UTF-8 text: byte {exc.start} (line {line}) is {byte!r}",
                        "save the job file as UTF-8 text (a job file is YAML, not a binary file)") from None


def _yaml_error(exc: yaml.YAMLError, source: str) -> SpecError:
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    reason = getattr(exc, "problem", None) or str(exc)
    line_fix = f" near line {mark.line + 1}" if mark else ""
    return SpecError(
        None,
        source,
        f"is not valid YAML{where}: {reason}",
        f"correct the YAML{line_fix}: check indentation, and that each `key: value` has a space after the colon",
    )


def parse_yaml(text: str, source: str, at: tuple[str, ...] = ()) -> Any:
    """YAML text -> Python values with `StrictLoader`; duplicate keys and syntax errors become `SpecError`s.

    `at` is where the text sits in the job (an override's key path), so a duplicate key is named in full."""
    loader = StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, at, source)
        size = _expanded_size(node, {})
        if size > MAX_VALUES:
            raise SpecError(None, source, f"expands to {size:,} values through YAML aliases (*name)",
                            f"write the job without nested aliases; a job file holds far fewer than {MAX_VALUES:,}")
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, source) from None
    except RecursionError:  # PyYAML's composer, and these walks, recurse once per level of nesting
        raise SpecError(None, source, "nests lists or mappings too deep to read",
                        "a job file nests sections a few levels deep; remove the runaway brackets") from None
    finally:
        loader.dispose()


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
    field = ".".join(parts)
    if any("\udc80" <= c <= "\udcff" or c == "\x00" for c in text):  # argv bytes that were not UTF-8
        raise SpecError(field, raw, "holds bytes that are not UTF-8 text (or a NUL byte)",
                        f"pass `{field}=<value>` as plain UTF-8 text", where=f"override `{field}`")
    try:
        value = parse_yaml(raw, f"override `{field}`", parts)
    except SpecError as exc:
        if exc.field is not None:  # a duplicate key inside a flow mapping value
            raise
        raise SpecError(field, raw, "is not a valid YAML value", "quote the value, e.g. `name='my job'`",
                        where=f"override `{field}`") from None
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
