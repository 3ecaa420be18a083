"""The command-line reference, generated from the argparse parser ``raymesh`` runs (one source of truth): the
documentation site's build hook (docs/hooks.py) renders :func:`cli_markdown` into docs/reference/cli.md."""

from __future__ import annotations

import argparse

from orchestrator.cli.commands import build_parser


def commands() -> dict[str, argparse.ArgumentParser]:
    """Each ``raymesh`` command's own parser, by name, in the order ``raymesh --help`` lists them."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(action: argparse.Action) -> str:
    names = action.option_strings or [action.dest]
    metavar = "" if action.nargs == 0 else f" {action.metavar or action.dest.upper()}" if action.option_strings else ""
    if action.choices is not None and action.nargs != 0:
        metavar = " {" + ",".join(map(str, action.choices)) + "}"
    return ", ".join(f"`{name}{metavar}`" for name in names)


def _cell(text: str | None) -> str:
    """Help text inside a Markdown table cell: no pipes, no line breaks."""
    return (text or "").replace("|", "\\|").replace("\n", " ")


def cli_markdown() -> str:
    """One section per command: what it does, its usage line and a table of its arguments."""
    lines = []
    for name, parser in commands().items():
        lines += [f"## `raymesh {name}`", "", parser.description or "", "", "```text",
                  parser.format_usage().strip(), "```", "", "| argument | default | what it does |", "|---|---|---|"]
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            unset = action.default is None or action.default is False or action.default == [] \
                or action.default is argparse.SUPPRESS
            default = "required" if action.required or not action.option_strings else \
                "" if unset else f"`{action.default}`"
            lines.append(f"| {_flags(action)} | {default} | {_cell(action.help)} |")
        lines.append("")
    return "\n".join(lines)
