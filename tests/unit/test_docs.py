"""README.md and the documentation site's pages (docs/**/*.md) against the code: the claims a reader acts on first
(commands and their options, job-file fields, event names, metric labels, examples, paths and names) must be the
code's, checked without Ray."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
from pathlib import Path

import pytest

from orchestrator.cli.commands import build_parser
from orchestrator.observability.prometheus import RECOVERY_KINDS
from orchestrator.runtime.group import _kind

REPO = Path(__file__).resolve().parents[2]
DOCS = {path.relative_to(REPO).as_posix(): path.read_text()
        for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]}
SOURCES = {path: path.read_text() for folder in ("orchestrator", "workers", "parameter_server", "tests", "benchmarks")
           for path in (REPO / folder).rglob("*.py")}
CODE = {path: text for path, text in SOURCES.items() if path.parts[len(REPO.parts)] != "tests"}


def _section(page: str, title: str) -> str:
    """The text of ``page`` (a path in the repository) from the heading ``title`` to the next heading."""
    text = "\n" + DOCS[page]
    start = text.index(f"\n{title}\n")
    end = re.search(r"\n#{1,4} ", text[start + len(title) + 2:])
    return text[start:start + len(title) + 2 + (end.start() if end else len(text))]


def test_the_event_list_is_every_event_the_code_emits():
    monitoring = DOCS["docs/guides/monitoring.md"]
    paragraph = monitoring[monitoring.index("**Logs.** One line per event"):]
    paragraph = paragraph[:paragraph.index("The controller actor writes them")]
    listed = set(re.findall(r"`([a-z_]+)`", paragraph.split(":", 1)[1]))
    emitted = {name for text in CODE.values() for name in re.findall(r"\bevent\(\s*\"([a-z_]+)\"", text)}
    assert emitted - listed == set(), "emitted but not in docs/guides/monitoring.md's event list"
    assert listed - emitted == set(), "in docs/guides/monitoring.md's event list but never emitted"


def test_every_event_line_the_docs_quote_is_emitted():
    emitted = {name for text in CODE.values()
               for name in re.findall(r"\bevent\(\s*\"([a-z_]+)\"|raymesh event=([a-z_]+)", text) for name in name}
    for doc, text in DOCS.items():
        quoted = set(re.findall(r"event=([a-z_]+)", text))
        assert quoted <= emitted, f"{doc} quotes events nothing emits: {quoted - emitted}"


def _options() -> dict[str, set[str]]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {s for action in parser._actions for s in action.option_strings}
            for name, parser in sub.choices.items()}


def _command_lines(text: str):
    """(command, the rest of its line) for each ``raymesh CMD ...`` in a code span or block."""
    for piece in re.findall(r"```.*?```", text, re.S) + re.findall(r"`[^`\n]+`", text):
        for match in re.finditer(r"\braymesh ([a-z][a-z-]+)([^\n`|;#]*)", piece.replace("\\\n", " ")):
            yield match.group(1), re.split(r"\braymesh |&&|\|\|", match.group(2))[0], match.group(0)


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_command_and_option_the_docs_give_exists(doc):
    options = _options()
    wrong = []
    for command, rest, said in _command_lines(DOCS[doc]):
        if command == "event" or (command == "namespace" and "raymesh namespace" in said):
            continue  # log lines, Ray's namespace
        if command not in options:
            wrong.append(f"no command: {said}")
            continue
        wrong += [f"{command} has no {o}: {said}" for o in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest)
                  if o not in options[command]]
    assert not wrong


def test_the_command_table_names_every_command():
    table = _section("docs/reference/commands.md", "# Commands")
    named = {name for name, _, _ in _command_lines(table)}
    assert set(_options()) - named == set()


def test_the_examples_table_lists_every_example_and_only_those():
    listed = re.findall(r"^\| `(examples/[^`]+\.yaml)` \|", _section("docs/examples.md", "# Examples"), re.M)
    assert len(listed) == len(set(listed))
    assert set(listed) == {p.relative_to(REPO).as_posix() for p in (REPO / "examples").glob("*.yaml")}


# The job-file reference is generated from the schema (docs/reference/job-file.md's marker, docs/hooks.py): its
# completeness and the schema's are tests/unit/test_docs_reference.py's.


def test_the_recovery_kinds_metric_starts_every_kind_a_recovery_can_have():
    metrics = _section("docs/guides/monitoring.md", "## Metrics")
    row = next(line for line in metrics.splitlines() if line.startswith("| `raymesh_recoveries_total`"))
    assert set(re.search(r"`kind` \(([^)]*)\)", row).group(1).replace("`", "").split(", ")) == set(RECOVERY_KINDS)
    # StepFailed's kinds (a lost rank, a hang, a rank's own OOM or exception), a lost node, a NaN, a bad checkpoint,
    # a restarted parameter-server shard
    kinds = {_kind(["killed"]), _kind(["hung"]), _kind(["ran out of memory"]), _kind(["raised (x)"]),
             "node", "nan_loss", "corrupt_checkpoint", "ps_shard"}
    assert kinds <= set(RECOVERY_KINDS)


def test_every_repository_path_the_docs_name_exists():
    missing = []
    for doc, text in DOCS.items():
        for span in set(re.findall(r"`([^`\s]+)`", text)):
            path = span.split("::")[0]
            if re.fullmatch(r"(orchestrator|workers|parameter_server|benchmarks|tests|deploy|dashboards|examples|docs)"
                            r"/[\w./-]*", path) and "*" not in path and not (REPO / path).exists():
                missing.append(f"{doc}: {span}")
    assert not missing


def test_every_file_and_symbol_pair_the_docs_name_is_defined_there():
    wrong = []
    for doc, text in DOCS.items():
        for path, dotted in set(re.findall(r"`([\w/]+\.py)::([\w.]+)`", text)):
            files = [p for p in SOURCES if p.relative_to(REPO).as_posix().endswith(path)]
            head, _, method = dotted.partition(".")
            found = False
            for file in files:
                body = SOURCES[file]
                if method:
                    cls = re.search(rf"^class {head}\b.*?(?=^class |\Z)", body, re.S | re.M)
                    body = cls.group(0) if cls else ""
                found |= re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{method or head}\b|^{method or head}\s*[:=]",
                                   body, re.M) is not None
            if not found:
                wrong.append(f"{doc}: {path}::{dotted}")
    assert not wrong


def test_every_class_member_the_docs_name_exists():
    """`Class.member` where Class is one of the repository's: a method, a property or an attribute it sets."""
    bodies = {}
    for text in SOURCES.values():
        for match in re.finditer(r"^class (\w+)\b.*?(?=^class |\Z)", text, re.S | re.M):
            bodies[match.group(1)] = bodies.get(match.group(1), "") + match.group(0)
    wrong = []
    for doc, text in DOCS.items():
        for cls, member in set(re.findall(r"`([A-Z]\w+)\.(_?[a-z]\w*)(?:\([^`]*\))?`", text)):
            if cls in bodies and not re.search(
                    rf"^\s*(?:async\s+)?def {member}\b|^\s*{member}\s*[:=]|self\.{member}\s*[:=]", bodies[cls], re.M):
                wrong.append(f"{doc}: {cls}.{member}")
    assert not wrong


def _python_import_problems(text: str) -> list[str]:
    """Each ```python block of ``text`` that does not parse, or imports from raymesh a name that is not there."""
    problems = []
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        try:
            tree = ast.parse(block)
        except SyntaxError as exc:
            problems.append(f"does not parse: {exc}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
                    "orchestrator", "workers", "parameter_server"):
                module = importlib.import_module(node.module)
                problems += [f"{node.module} has no {alias.name}" for alias in node.names
                             if not hasattr(module, alias.name)]
    return problems


def test_every_python_block_the_docs_show_parses_and_imports_real_names():
    wrong = [f"{doc}: {problem}" for doc, text in DOCS.items() for problem in _python_import_problems(text)]
    assert not wrong
    assert _python_import_problems("```python\nfrom orchestrator import TrainingJobs\n```\n") == [
        "orchestrator has no TrainingJobs"]
