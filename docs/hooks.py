"""MkDocs build hook: the generated references, rendered from the code at build time so they cannot drift.

A page holding ``<!-- generated: NAME -->`` gets that marker replaced by the generator's Markdown: the job-file
reference from the pydantic schema (``orchestrator.spec.reference``), the CLI reference from the argparse parser
(``orchestrator.cli.reference``). The Python API page uses mkdocstrings (mkdocs.yml) for the docstrings.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# this checkout's code, not an installed copy; imported now: MkDocs restores sys.path once the hook is loaded
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from orchestrator.cli.reference import cli_markdown
from orchestrator.spec.reference import job_file_markdown

GENERATORS = {"job-file": job_file_markdown, "cli": cli_markdown}


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Replace each ``<!-- generated: NAME -->`` marker with its generator's Markdown; an unknown name fails."""
    def render(match: re.Match) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"{page.file.src_uri}: no generator named {name!r}; known: {sorted(GENERATORS)}")
        return GENERATORS[name]()

    return re.sub(r"<!-- generated: ([\w-]+) -->", render, markdown)
