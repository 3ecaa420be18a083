"""The generated references and the job file's JSON Schema: one source of truth, the code.

Every job-file field (walked through the pydantic models, independently of the generator) has a meaning and an
entry in the generated job-file reference; every flag of every command is in the generated CLI reference;
`raymesh schema` is what docs/job.schema.json holds, every example names that file and validates against it, and
a job file with an unknown key does not; the job-file snippets the docs show use real fields."""

from __future__ import annotations

import argparse
import io
import json
import re
import typing
from contextlib import redirect_stdout
from pathlib import Path

import jsonschema
import pytest
from pydantic import BaseModel

from orchestrator.cli.commands import main
from orchestrator.cli.reference import cli_markdown, commands
from orchestrator.spec.field_docs import FIELD_DOCS
from orchestrator.spec.job import JobSpec
from orchestrator.spec.raw import parse_yaml
from orchestrator.spec.reference import SCHEMA_FILE, job_file_markdown, job_schema

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
SCHEMA_COMMENT = "# yaml-language-server: $schema=../docs/job.schema.json"


def _models(annotation) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation holds (through Optional, lists, unions and Annotated)."""
    found, todo = [], [annotation]
    while todo:
        item = todo.pop()
        if isinstance(item, type) and issubclass(item, BaseModel):
            found.append(item)
        todo += typing.get_args(item)
    return found


def job_fields(model: type[BaseModel] = JobSpec, prefix: str = "") -> dict[str, typing.Any]:
    """Every field of the job file by dotted path (aliases as the file spells them), walked from the models."""
    out = {}
    for name, field in model.model_fields.items():
        path = prefix + (field.alias or name)
        out[path] = field
        for sub in _models(field.annotation)[:1]:
            out |= job_fields(sub, path + ".")
    return out


def missing_fields(markdown: str) -> list[str]:
    """The job-file fields without an entry (a heading naming it) in ``markdown``; one named twice counts too."""
    entries = re.findall(r"^#{2,3} `([\w.]+)`$", markdown, re.M)
    twice = sorted({path for path in entries if entries.count(path) > 1})
    return [path for path in job_fields() if path not in entries] + [f"{path} (twice)" for path in twice]


def missing_flags(markdown: str) -> list[str]:
    """``command flag`` for each flag (and positional) of each command not in its section of ``markdown``."""
    wrong = []
    for name, parser in commands().items():
        section = re.search(rf"^## `raymesh {name}`\n(.*?)(?=^## |\Z)", markdown, re.S | re.M)
        text = section.group(1) if section else ""
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings or [action.dest]:
                if not re.search(rf"^\| (?:`[^`]+`, )*`{re.escape(flag)}[` ][^|]*\|", text, re.M):
                    wrong.append(f"{name} {flag}")
    return wrong


def test_every_job_file_field_has_an_entry_in_the_generated_reference():
    markdown = job_file_markdown()
    assert len(job_fields()) > 150
    assert missing_fields(markdown) == []
    # the check above can fail: an entry taken out is reported
    without = markdown.replace("### `train.loss_chunks`\n", "")
    assert missing_fields(without) == ["train.loss_chunks"]


def test_every_job_file_field_says_what_it_does():
    """A meaning from ``Field(description=...)`` or field_docs, and no field_docs entry for a field that is gone."""
    fields = job_fields()
    sections = {path for path, field in fields.items() if _models(field.annotation)}
    undescribed = [path for path, field in fields.items()
                   if path not in sections and not field.description and not FIELD_DOCS.get(path)]
    assert undescribed == []
    assert sorted(set(FIELD_DOCS) - set(fields)) == []


def test_every_command_and_flag_is_in_the_generated_cli_reference():
    markdown = cli_markdown()
    assert missing_flags(markdown) == []
    assert missing_flags(markdown.replace("| `--resume` |", "| resume |")) == ["run --resume"]
    assert set(re.findall(r"^## `raymesh ([\w-]+)`", markdown, re.M)) == set(commands())


def test_the_committed_schema_is_what_raymesh_schema_prints():
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["schema"]) == 0
    printed = json.loads(out.getvalue())
    assert printed == json.loads((REPO / SCHEMA_FILE).read_text()), \
        f"{SCHEMA_FILE} is stale: PYTHONPATH=$PWD python -m orchestrator.cli schema > {SCHEMA_FILE}"
    jsonschema.Draft202012Validator.check_schema(printed)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_names_the_schema_and_validates_against_it(example):
    text = example.read_text()
    assert text.splitlines()[0] == SCHEMA_COMMENT
    assert (example.parent / SCHEMA_COMMENT.split("=", 1)[1]).resolve() == (REPO / SCHEMA_FILE).resolve()
    jsonschema.validate(parse_yaml(text, str(example)), job_schema())


def test_the_schema_rejects_an_unknown_key_and_a_bad_value():
    job = parse_yaml((REPO / "examples" / "gpt_tiny_3d.yaml").read_text(), "gpt_tiny_3d.yaml")
    schema = job_schema()
    with pytest.raises(jsonschema.ValidationError, match="tpp"):
        jsonschema.validate({**job, "parallel": {**job["parallel"], "tpp": 2}}, schema)
    with pytest.raises(jsonschema.ValidationError, match="trainn"):
        jsonschema.validate({**job, "trainn": {}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**job, "parallel": {**job["parallel"], "tp": 0}}, schema)


def test_the_schema_takes_every_form_the_loader_takes_for_loggers():
    """`loggers:` as a mapping, as a list of names and one-key mappings (LoggersSpec's own reading) or empty (YAML
    null: the defaults, as for every section), not more."""
    job = parse_yaml((REPO / "examples" / "gpt_tiny_3d.yaml").read_text(), "gpt_tiny_3d.yaml")
    schema = job_schema()
    for loggers in ({"tensorboard": None}, ["tensorboard", {"mlflow": {"experiment": "x"}}], None):
        JobSpec.from_dict({**job, "loggers": loggers})  # the loader takes it: so must the schema
        jsonschema.validate({**job, "loggers": loggers}, schema)
    for wrong in (["tensorbored"], [{"mlflow": {}, "wandb": {}}], {"mlflow": {"experimentt": "x"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**job, "loggers": wrong}, schema)
    JobSpec.from_dict({**job, "checkpoint": None})
    jsonschema.validate({**job, "checkpoint": None}, schema)


def _without_required(node):
    """The schema with no field required: the docs' snippets are parts of job files."""
    if isinstance(node, dict):
        return {key: _without_required(value) for key, value in node.items() if key != "required"}
    return [_without_required(value) for value in node] if isinstance(node, list) else node


def yaml_snippet_problems(text: str, source: str) -> list[str]:
    """Each ```yaml block of ``text`` that is (part of) a job file, checked against the schema."""
    schema = _without_required(job_schema())
    problems = []
    for block in re.findall(r"```ya?ml\n(.*?)```", text, re.S):
        data = parse_yaml(block, source)
        if isinstance(data, dict) and data:
            problems += [f"{source}: {'.'.join(map(str, e.absolute_path))}: {e.message}"
                         for e in jsonschema.Draft202012Validator(schema).iter_errors(data)]
    return problems


def test_every_job_file_snippet_in_the_docs_uses_real_fields():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    assert [p for page in pages for p in yaml_snippet_problems(page.read_text(), str(page))] == []
    wrong = "```yaml\nparallel: {dp: 2, tpp: 2}\n```\n"
    assert any("tpp" in p for p in yaml_snippet_problems(wrong, "probe.md"))


def test_the_reference_pages_hold_the_generator_markers():
    """The hook renders into these pages only where they say so (docs/hooks.py)."""
    assert "<!-- generated: job-file -->" in (REPO / "docs/reference/job-file.md").read_text()
    assert "<!-- generated: cli -->" in (REPO / "docs/reference/cli.md").read_text()
